"""Turning completed chunks into the batches a trainer consumes.

:class:`BatchAssembler` builds dense batches of exactly ``n`` transitions
from whole chunks (one copy per field; a run of full-width chunks is one
gather), splitting a chunk only where a batch ends and carrying its rest, in
order, into the next batch; :class:`ChunkQueue` does the same for chunks
held as numpy fields in the driver (from Ray hosts). :class:`TrajectoryAssembler` regroups such
batches into whole finished trajectories for trainers that want episodes.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from components.collector.batch_memory import BatchMemory
from components.collector.chunks import ChunkPool
from components.obs_tree import ObsLeaf, observation_tree
from components.successors import CutSuccessors, cut_table


def nest(flat: Mapping[str, torch.Tensor], obs_leaves: Sequence[ObsLeaf] = ()) -> dict[str, Any]:
    """``{"next.reward": t}`` -> ``{"next": {"reward": t}}``.

    ``obs_leaves``: a Dict/Tuple observation's leaves; its packed
    ``observation`` fields become nested ``TensorDict``s of leaf views
    (:func:`~components.obs_tree.observation_tree`), as every reader past
    the collector sees them.
    """
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = observation_tree(obs_leaves, value) if obs_leaves and leaf == "observation" else value
    return out


#: pending chunk bytes from which the driver copies them out before it waits for the next chunk (a copy that
#: long keeps workers from their buffers; shorter ones are cheaper gathered at the end)
EARLY_COPY_BYTES = 1 << 20


class BatchAssembler:
    """Exact batches out of a chunk pool; ``next_chunk`` blocks for the next complete chunk id.

    Big chunks are copied out and released as they arrive, not once the
    whole batch is in: a chunk the driver holds is one its worker cannot
    fill, and with the buffers sized for about one batch ahead, holding every
    chunk of a batch until its last one came made the workers wait for the
    driver's copies (raw 210x160x3 frames: workers waiting for a free chunk
    43 % of their time, 21 % copied as they come, +14 % frames/s). Small
    chunks are copied at the end, as one gather per field: on CartPole,
    copying each chunk as it came cost the driver enough CPU to lose 10 %.
    """

    def __init__(self, pool: ChunkPool, next_chunk: Callable[[], int],
                 ready_chunk: Callable[[], int | None] | None = None, early_copy_bytes: int = EARLY_COPY_BYTES,
                 obs_leaves: Sequence[ObsLeaf] = ()) -> None:
        self._pool = pool
        self._obs_leaves = tuple(obs_leaves)
        self._early_copy_bytes = early_copy_bytes
        self._next_chunk = next_chunk
        #: the next complete chunk id if one is ready now, else None (never blocks)
        self._ready_chunk = ready_chunk if ready_chunk is not None else lambda: pool.next_ready(0.0)
        self._carry: tuple[int, int] | None = None  # (chunk, first frame not yet delivered)
        self.memory = BatchMemory()
        #: without dense successors: the stream's successor field left out of every batch
        self._cut = None if pool.dense_successor else pool.successor
        #: the shape and torch dtype of one streamed observation (an empty table's)
        self._stream_row = next(((tuple(f.shape), getattr(torch, f.dtype)) for f in pool.fields
                                 if f.name == pool.stream), None)
        #: per field: its name, one transition's shape, its torch dtype (looked up once, not per batch)
        self._fields = [(f.name, tuple(f.shape), getattr(torch, f.dtype)) for f in pool.fields if f.name != self._cut]
        self._frame_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self._fields)
        #: ``(env_index, env_step, successor)`` per chunk piece of the batch being assembled (no dense successors)
        self._cut_pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        #: the :class:`CutSuccessors` of the last batch (None with dense successors)
        self.cut_successors: CutSuccessors | None = None

    def next_batch(self, n: int) -> dict[str, torch.Tensor]:
        """Flat field tensors of the next ``n`` transitions, in arrival order per chunk."""
        pool = self._pool
        out = {name: self.memory.empty((n, *shape), dtype) for name, shape, dtype in self._fields}
        pending: list[tuple[int, int, int]] = []  # (chunk, first frame, frames taken), not copied yet
        filled = pos = held = 0  # held: frames pending
        while filled < n:
            if self._carry is not None:
                (gid, start), self._carry = self._carry, None
            else:
                big = held * self._frame_bytes >= self._early_copy_bytes
                ready = self._ready_chunk() if big else None
                if big and ready is None:  # copy out (and free) what came before waiting for more
                    pos = self._copy(pending, out, pos)
                    pending, held = [], 0
                gid, start = (ready if ready is not None else self._next_chunk()), 0
            available = pool.frames_in(gid) - start
            take = min(available, n - filled)
            pending.append((gid, start, take))
            filled += take
            held += take
            if take < available:
                self._carry = (gid, start + take)
        self._copy(pending, out, pos)
        if self._cut is not None:
            self.cut_successors = cut_table(self._cut_pieces, *self._stream_row, leaves=self._obs_leaves)
            self._cut_pieces = []
        return out

    def _copy(self, segments: list[tuple[int, int, int]], out: dict[str, torch.Tensor], pos: int) -> int:
        """Copy ``segments`` into ``out`` from row ``pos`` on, release each chunk not carried; the next row."""
        pool = self._pool
        i = 0
        while i < len(segments):
            j = i
            while j < len(segments) and self._whole(segments[j]):
                j += 1
            if j - i >= 2:
                pos += pool.gather_into([s[0] for s in segments[i:j]], out, pos)
                if self._cut is not None:
                    for gid, start, take in segments[i:j]:
                        self._record_cut(gid, start, take)
                i = j
                continue
            gid, start, take = segments[i]
            pool.copy_into(gid, start, take, out, pos)
            if self._cut is not None:
                self._record_cut(gid, start, take)
            pos += take
            i += 1
        for gid, _, _ in segments:
            if self._carry is None or self._carry[0] != gid:
                pool.release(gid)
        return pos

    def _record_cut(self, gid: int, start: int, take: int) -> None:
        """Keep the successors of a piece's frames whose next frame may be outside it (before its chunk is freed)."""
        self._cut_pieces.append(self._pool.cut_successors(gid, start, take))

    def _whole(self, segment: tuple[int, int, int]) -> bool:
        gid, start, take = segment
        return start == 0 and take == self._pool.frames_in(gid) and self._pool.full_width(gid)


class ChunkQueue:
    """Exact batches out of chunks that arrive as flat numpy fields (a Ray host's answers), in arrival order.

    The counterpart of :class:`BatchAssembler` for chunks that live in the
    driver's memory, not in a shared pool: a chunk is split only where a
    batch ends and its rest opens the next batch.

    Examples:
        >>> q = ChunkQueue()
        >>> q.append({"x": np.arange(3)}); q.append({"x": np.arange(3, 6)})
        >>> q.take(4)["x"].tolist(), q.frames
        ([0, 1, 2, 3], 2)
    """

    def __init__(self) -> None:
        self._chunks: collections.deque[dict[str, np.ndarray]] = collections.deque()
        self.frames = 0

    def append(self, fields: dict[str, np.ndarray]) -> None:
        self._chunks.append(fields)
        self.frames += len(next(iter(fields.values())))

    def take(self, n: int) -> dict[str, torch.Tensor]:
        """Flat field tensors of the next ``n`` transitions (``n`` <= :attr:`frames`)."""
        if n > self.frames:
            raise ValueError(f"{n} transitions asked of a queue holding {self.frames}")
        parts, taken = [], 0
        while taken < n:
            chunk = self._chunks[0]
            size = len(next(iter(chunk.values())))
            want = n - taken
            if size <= want:
                parts.append(self._chunks.popleft())
                taken += size
            else:  # the rest of this chunk opens the next batch, in order
                parts.append({k: v[:want] for k, v in chunk.items()})
                self._chunks[0] = {k: v[want:] for k, v in chunk.items()}
                taken += want
        self.frames -= n
        return {k: torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in parts[0]}


class TrajectoryAssembler:
    """Whole finished trajectories, at least ``min_frames`` transitions per yield.

    Transitions are kept per env until that env's episode ends (``done``);
    finished trajectories queue up and leave together once they hold
    ``min_frames`` transitions, each one contiguous and in step order.
    Unfinished trajectories stay here (in host memory, bounded by episode
    length times envs) and are dropped when collection ends.

    Examples:
        >>> from tensordict import TensorDict
        >>> done = torch.tensor([False, False, True, False, True, False])
        >>> batch = TensorDict({"env_index": torch.tensor([0, 1, 0, 1, 1, 0]),
        ...                     "env_step": torch.tensor([0, 0, 1, 1, 2, 2]),
        ...                     "next": {"done": done}}, [6])
        >>> out = TrajectoryAssembler(min_frames=4).add(batch)
        >>> out["env_index"].tolist(), out["env_step"].tolist()
        ([0, 0, 1, 1, 1], [0, 1, 0, 1, 2])
    """

    def __init__(self, min_frames: int) -> None:
        self.min_frames = min_frames
        self._open: dict[int, list[Any]] = {}
        self._finished: list[Any] = []
        self._finished_frames = 0

    def add(self, batch: Any) -> Any | None:
        """Take in a batch; return the finished trajectories once there are enough, else None."""
        env = batch["env_index"].numpy()
        done = batch["next", "done"].numpy()
        for e in np.unique(env):
            rows = np.flatnonzero(env == e)
            ends = rows[done[rows]]
            first = 0
            for end in ends:
                part = rows[first : int(np.searchsorted(rows, end)) + 1]
                pieces = self._open.pop(int(e), [])
                pieces.append(batch[torch.from_numpy(part)])
                trajectory = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
                self._finished.append(trajectory)
                self._finished_frames += trajectory.numel()
                first = len(part) + first
            if first < len(rows):
                self._open.setdefault(int(e), []).append(batch[torch.from_numpy(rows[first:])])
        if self._finished_frames < self.min_frames:
            return None
        out = torch.cat(self._finished)
        self._finished, self._finished_frames = [], 0
        return out
