"""The lock-free half of writing frame stacks: which frames of a batch repeat earlier ones, and hashes of the rest.

Why match inside the batch first: in a stream of stacked observations almost
every frame is a copy of a frame next to it, at a fixed offset. A transition's
observation is its env's previous next-observation (1-step data), or that
observation shifted by one (n-step data); its next-observation is its
observation shifted by one (1-step) or the previous next-observation shifted
by one (n-step). Comparing those contiguous sub-stacks byte for byte settles
all but about one frame per transition, which then needs a crc32 and a table
lookup in :class:`~components.replay.frames.FrameStackStorage`. None of this
reads shared state, so it runs before the replay buffer takes its lock.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDictBase

from components.replay.storage import Key, leaves_of, rows_of

#: (source row, source key index, offset): frames ``j`` of this stack equal frames ``j + offset`` of the source.
Alias = tuple[int, int, int]


@dataclass
class FrameBatch:
    """A batch split into plain leaves and matched, hashed frame stacks.

    Per stacked key and kept row (rows ``skip..rows-1``): ``aliases`` says
    which leading frames repeat an earlier stack of this batch (``None``: no
    match) and ``crcs`` holds the crc32 of every frame not covered by the
    alias (``None`` where it is covered).
    """

    leaves: dict[Key, torch.Tensor]
    stacks: list[np.ndarray]  # per stacked key: [rows, stack, *frame_shape], C-contiguous
    aliases: list[list[Alias | None]]
    crcs: list[list[list[int | None]]]
    envs: list[int]
    rows: int
    skip: int  # leading rows dropped because the batch exceeds the capacity
    stack: int

    @property
    def frame_shape(self) -> tuple[int, ...]:
        return tuple(self.stacks[0].shape[2:])

    @property
    def dtype(self) -> torch.dtype:
        return torch.from_numpy(self.stacks[0][:0]).dtype


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    # tobytes + bytes equality: a memcmp after two copies, faster than np.array_equal on a few KB.
    return a.tobytes() == b.tobytes()


def split_frames(batch: TensorDictBase, frame_keys: Sequence[Key], env_key: Key, capacity: int) -> FrameBatch:
    """Take the stacked keys out of ``batch``, match their frames within the batch and hash the rest.

    Examples:
        >>> from tensordict import TensorDict
        >>> f = torch.arange(5, dtype=torch.uint8).view(5, 1).expand(5, 3).clone()   # frames 0..4 of 3 bytes
        >>> obs, nxt = torch.stack([f[0:2], f[1:3]]), torch.stack([f[1:3], f[2:4]])  # 2 steps, stacks of 2
        >>> fb = split_frames(TensorDict({"o": obs, "n": nxt}, [2]), [("o",), ("n",)], ("env",), 10)
        >>> fb.aliases    # per key, per row: "o" of row 1 is row 0's "n"; each "n" is its "o" shifted by 1
        [[None, (0, 1, 0)], [(0, 0, 1), (1, 0, 1)]]
        >>> [[c is not None for c in row] for row in fb.crcs[1]]  # only each "n"'s newest frame is hashed
        [[False, True], [False, True]]
    """
    rows = rows_of(batch)
    leaves = leaves_of(batch)
    skip = max(0, rows - capacity)
    stacks: list[np.ndarray] = []
    for key in frame_keys:
        if key not in leaves:
            raise KeyError(f"FrameStackStorage needs the stacked key {key} in every batch")
        value = leaves.pop(key)
        if value.dim() < 2 or (stacks and value.shape[1:] != stacks[0].shape[1:]):
            raise ValueError(f"{key}: expected [N, stack, *frame_shape] like the other stacked keys, "
                             f"got {list(value.shape)}")
        stacks.append(np.ascontiguousarray(value.detach().cpu().numpy()))
    stack = int(stacks[0].shape[1])
    envs = leaves[env_key].reshape(-1).tolist() if env_key in leaves else [0] * rows
    leaves = {k: v.cpu() for k, v in leaves.items()}

    aliases: list[list[Alias | None]] = [[] for _ in frame_keys]
    crcs: list[list[list[int | None]]] = [[] for _ in frame_keys]
    last = len(frame_keys) - 1
    previous: dict[int, int] = {}  # env -> its latest kept row
    for i in range(skip, rows):
        prev = previous.get(envs[i])
        for k, stacked in enumerate(stacks):
            x = stacked[i]
            alias: Alias | None = None
            if k == 0 and prev is not None and _same(x, stacks[last][prev]):
                alias = (prev, last, 0)  # 1-step: this observation is the previous next-observation
            elif k > 0 and _same(x[:-1], stacks[k - 1][i][1:]):
                alias = (i, k - 1, 1)  # 1-step: next-observation = observation shifted by one
            elif prev is not None and _same(x[:-1], stacked[prev][1:]):
                alias = (prev, k, 1)  # n-step: this stack = the env's previous one shifted by one
            covered = 0 if alias is None else stack - alias[2]
            aliases[k].append(alias)
            crcs[k].append([None] * covered + [zlib.crc32(x[j]) for j in range(covered, stack)])
        previous[envs[i]] = i
    return FrameBatch(leaves, stacks, aliases, crcs, envs, rows, skip, stack)
