"""Cutting a batch of transitions into the fixed-length sequences truncated BPTT trains on.

Why a separate step from the advantages: GAE runs on the whole batch, in
(env, step) order, across what will become sequence boundaries, so it is
exactly the unsplit computation; only the loss is evaluated per sequence.
A sequence is ``seq_len`` consecutive steps of one env that never crosses
the end of an episode, a gap in the env's steps (a worker restart, a
restart point) or another env: where a trajectory ends early the sequence
is padded, and ``mask`` says which places are real. Each sequence starts
where a trajectory starts in the batch (an episode's first step, a
replaced env's, or the first of this env's steps in the batch) or
``seq_len`` steps after the previous one; the recurrent state recorded with
that row (zero after a reset) is the one to start from, so a minibatch of
whole sequences needs nothing but the rows' own data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Sequences:
    """Row indices of a batch laid out as ``[num_sequences, seq_len]``.

    Attributes:
        index: the batch row at each place (0 where padded: see ``mask``).
        mask: whether a place holds a real row.
        starts: the row each sequence starts with (its recorded state is the sequence's initial one).
    """

    index: torch.Tensor
    mask: torch.Tensor
    starts: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.index.shape[0])

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (one per batch row) as ``[num_sequences, seq_len, ...]``, zeros where padded."""
        out = values[self.index.reshape(-1)].reshape(*self.index.shape, *values.shape[1:])
        mask = self.mask.reshape(*self.mask.shape, *([1] * (values.dim() - 1)))
        return out * mask.to(out.dtype) if out.is_floating_point() else out.masked_fill(~mask, 0)


def trajectory_starts(env: np.ndarray, step: np.ndarray, done: np.ndarray) -> np.ndarray:
    """Whether each row (sorted by env, then step) starts a trajectory: a new env, a step gap, or after an end."""
    starts = np.ones(len(env), bool)
    starts[1:] = (env[1:] != env[:-1]) | (step[1:] != step[:-1] + 1) | done[:-1]
    return starts


def split_sequences(env: np.ndarray, step: np.ndarray, done: np.ndarray, seq_len: int | None) -> Sequences:
    """The sequences of a batch whose rows are sorted by (env, step) (``done``: the episode ended at that row).

    ``seq_len`` None: each trajectory in the batch is one sequence (padded to the longest).

    Examples:
        >>> s = split_sequences(np.array([0, 0, 0, 1, 1]), np.array([5, 6, 7, 0, 1]),
        ...                     np.array([False, True, False, False, False]), seq_len=2)
        >>> s.index.tolist(), s.mask.tolist(), s.starts.tolist()
        ([[0, 1], [2, 0], [3, 4]], [[True, True], [True, False], [True, True]], [0, 2, 3])
    """
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    env, step, done = np.asarray(env), np.asarray(step), np.asarray(done, bool)
    if len(env) and (np.any(env[1:] < env[:-1]) or np.any((env[1:] == env[:-1]) & (step[1:] <= step[:-1]))):
        raise ValueError("rows must be sorted by env, then by step, each step once")
    begins = trajectory_starts(env, step, done)
    trajectory = np.cumsum(begins) - 1  # which trajectory each row belongs to
    offset = np.arange(len(env)) - np.flatnonzero(begins)[trajectory]  # steps since its trajectory began
    if seq_len is None:
        seq_len = int(offset.max()) + 1 if len(env) else 1
    opens = (offset % seq_len) == 0  # a sequence opens at a trajectory start and every seq_len steps in
    sequence = np.cumsum(opens) - 1
    count = int(sequence[-1]) + 1 if len(env) else 0
    column = offset % seq_len
    index = np.zeros((count, seq_len), np.int64)
    mask = np.zeros((count, seq_len), bool)
    index[sequence, column] = np.arange(len(env))
    mask[sequence, column] = True
    return Sequences(torch.from_numpy(index), torch.from_numpy(mask), torch.from_numpy(np.flatnonzero(opens)))
