"""Lockstep collection: every batch is the same steps of every env, served by that batch's weights.

Why: asynchronous collection lets whoever is ready run ahead, so which
policy version served a step, and which rows make a batch, depend on
timing. A reproducible run (``deterministic=true``) needs neither to: here
the driver asks for a batch by granting each worker its next ``T`` turns
(``frames_per_batch = T * num_envs``; a worker turn steps each of its envs
once), a worker sends no request past its grant (see
:mod:`components.collector.worker`), and a batch leaves the collector in
one fixed order (time-major, envs in index order) after checking that one
policy version, the last one published before the grant, served all of it.
The cost is the overlap: workers wait while the trainer updates.
"""

from __future__ import annotations

import math
import numpy as np
import torch

from components.collector.failures import CollectorError
from components.collector.graph import GraphSpec


def lockstep_problem(graph: GraphSpec, frames_per_batch: int, total_frames: int, max_restarts: int) -> str | None:
    """Why ``graph`` cannot collect in lockstep (None when it can)."""
    if graph.concurrent_envs:
        return "concurrent_envs steps envs in the order they return; lockstep needs blocks that step together"
    if max_restarts > 0:
        return "a relaunched worker starts its envs afresh, which a reproducible run cannot replay (max_restarts=0)"
    n = graph.num_envs
    if frames_per_batch % n:
        return f"frames_per_batch={frames_per_batch} is not a multiple of num_envs={n} (every env steps alike)"
    if total_frames > 0 and total_frames % n:
        return f"total_frames={total_frames} is not a multiple of num_envs={n}"
    turns = frames_per_batch // n
    last = (total_frames % frames_per_batch) // n if total_frames > 0 else 0
    if turns % graph.chunk_len or last % graph.chunk_len:
        return (f"chunk_len={graph.chunk_len} does not divide the {turns} steps per env of a batch"
                f"{f' or the {last} of the last' if last else ''} (use {lockstep_chunk_len(graph.chunk_len, turns, last)})")
    return None


def lockstep_chunk_len(planned: int, turns: int, last_turns: int = 0) -> int:
    """The longest chunk length up to ``planned`` that divides a batch's (and the last batch's) steps per env."""
    common = math.gcd(turns, last_turns) if last_turns else turns
    return max(d for d in range(1, min(planned, common) + 1) if common % d == 0)


class Lockstep:
    """The driver's side: grant the turns of each batch, then put the batch in its fixed order."""

    def __init__(self, granted: np.ndarray, num_envs: int, version: int) -> None:
        self._granted, self._num_envs = granted, num_envs
        self._turns = 0
        #: the version of the weights published last: the one every step of the next batch must carry
        self.published = int(version)
        granted[0] = 0  # workers hold even their first requests until the first batch is asked for

    def grant(self, frames: int) -> int:
        """Let every env take the steps of a batch of ``frames``; returns the version that must serve them."""
        self._turns += frames // self._num_envs
        self._granted[0] = self._turns
        return self.published

    @staticmethod
    def order(flat: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
        """``flat`` rows time-major, envs in index order; raises if a row was served by other weights."""
        served = flat["policy_version"]
        if bool((served != version).any()):
            others = sorted({int(v) for v in served.unique()} - {version})
            raise CollectorError(f"lockstep batch served by policy version(s) {others}, not {version}: "
                                 "the workers ran past their grant")
        order = torch.from_numpy(np.lexsort((flat["env_index"].numpy(), flat["env_step"].numpy())))
        return {key: value[order] for key, value in flat.items()}

