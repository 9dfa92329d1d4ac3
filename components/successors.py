"""Successor observations only where a trajectory leaves the batch: all an on-policy trainer reads.

A dense ``("next", "observation")`` is a second copy of almost every frame
in the batch: the successor of a transition is the observation of its env's
next transition, which the batch already holds. PPO reads a successor only
where the trajectory is cut (a truncated episode, or an env's last
transition in the batch) to bootstrap its value there. For such a trainer
the collector leaves the dense field out and records the successors of the
rows whose next transition is not in the batch (each env's last row of each
chunk piece, and every row whose episode ended: its final observation) in a
:class:`CutSuccessors` table, a few rows per chunk instead of every row.
On raw 210x160x3 frames that is the driver's second 100 KB copy a frame.

The table is keyed by ``(env_index, env_step)``, not by row, so it stays
right when a trainer drops or reorders rows (stale rows, a sort by env).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from components.obs_tree import ObsLeaf, model_observation

#: the batch's non-tensor entry holding the :class:`CutSuccessors` of a batch without dense successors
CUT_SUCCESSORS_KEY = "cut_successors"
#: ``env_index * _ENV_SPAN + env_step`` orders transitions by env, then step (steps stay far below 2**40)
_ENV_SPAN = 1 << 40


class CutSuccessors:
    """Successor observations of the transitions ``(env_index[i], env_step[i])``.

    ``observation``: one tensor of rows in table order, or the pieces that
    concatenate to it (the collector's, one per chunk piece: a lookup
    gathers the rows it needs from them instead of one concatenation of all).

    Examples:
        >>> t = CutSuccessors(torch.tensor([1, 0, 2]), torch.tensor([7, 3, 1]),
        ...                   [torch.tensor([[10.0], [20.0]]), torch.tensor([[30.0]])])
        >>> t.lookup(torch.tensor([2, 0, 1]), torch.tensor([1, 3, 7])).squeeze(1).tolist()
        [30.0, 20.0, 10.0]
    """

    def __init__(self, env_index: torch.Tensor, env_step: torch.Tensor,
                 observation: torch.Tensor | Sequence[torch.Tensor], leaves: Sequence[ObsLeaf] = ()) -> None:
        self.env_index, self.env_step = env_index, env_step
        #: a Dict/Tuple observation's leaves: lookups nest the packed rows as the batch's observations are
        self.leaves = tuple(leaves)
        self.pieces = (observation,) if isinstance(observation, torch.Tensor) else tuple(observation)
        sizes = [int(p.shape[0]) for p in self.pieces]
        if sum(sizes) != int(env_index.shape[0]) or env_step.shape != env_index.shape:
            raise ValueError(f"{int(env_index.shape[0])} keys for {sum(sizes)} successor rows")
        #: table row of each piece's first row
        self._starts = torch.tensor([0, *itertools.accumulate(sizes)][:-1], dtype=torch.long)

    def __len__(self) -> int:
        return int(self.env_index.shape[0])

    def lookup(self, env_index: torch.Tensor, env_step: torch.Tensor) -> torch.Tensor:
        """The successors of these transitions; a ``KeyError`` names the first one the table lacks."""
        keys = self.env_index * _ENV_SPAN + self.env_step
        sorted_keys, order = torch.sort(keys)
        wanted = env_index.to(keys.device) * _ENV_SPAN + env_step.to(keys.device)
        at = torch.searchsorted(sorted_keys, wanted).clamp(max=max(len(self) - 1, 0))
        found = sorted_keys[at] == wanted if len(self) else torch.zeros_like(wanted, dtype=torch.bool)
        if not bool(found.all()):
            miss = int((~found).nonzero()[0, 0])
            raise KeyError(f"no successor observation recorded for env {int(env_index[miss])} step "
                           f"{int(env_step[miss])} (recorded: those of episode ends and of each env's last "
                           "transition in the batch; read the others from the next transition's observation)")
        rows = order[at]
        first = self.pieces[0]
        out = first.new_empty((int(rows.shape[0]), *first.shape[1:]))
        piece = torch.searchsorted(self._starts, rows, right=True) - 1
        for p in piece.unique().tolist():
            mine = (piece == p).nonzero().squeeze(1)
            out[mine] = self.pieces[p][rows[mine] - self._starts[p]]
        return model_observation(self.leaves, out)


def reads_every_row(*, replay: bool, postproc: bool, hook: bool, trajectories: bool) -> bool:
    """Whether something besides the trainer reads every row's successor: then batches keep the dense field.

    Replay stores each transition whole (and its n-step post-processor
    shifts them), a ``post_collect_hook`` sees the batch as a user would,
    trajectory grouping concatenates batches: each needs every successor.
    """
    return replay or postproc or hook or trajectories


def successor_observations(batch: Any, rows: torch.Tensor) -> torch.Tensor:
    """``batch["next", "observation"][rows]``, from the dense field or the batch's :class:`CutSuccessors`.

    ``rows`` must be transitions whose next one is not in the batch (cut
    trajectories); with a dense field any row works.
    """
    if ("next", "observation") in batch.keys(include_nested=True):
        return batch["next", "observation"][rows]
    table = batch.get_non_tensor(CUT_SUCCESSORS_KEY)
    if table is None:
        raise KeyError("the batch has neither ('next', 'observation') nor its cut successors")
    return table.lookup(batch["env_index"][rows], batch["env_step"][rows])


def cut_table(pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], shape: tuple[int, ...],
              dtype: torch.dtype, leaves: Sequence[ObsLeaf] = ()) -> CutSuccessors:
    """One table from per-chunk-piece ``(env_index, env_step, observation)`` (observations of ``shape``, ``dtype``)."""
    if not pieces:
        return CutSuccessors(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                             torch.zeros((0, *shape), dtype=dtype), leaves)
    env, step, obs = zip(*pieces)
    return CutSuccessors(torch.cat(env), torch.cat(step), obs, leaves)
