"""Frame-stack storage: every distinct frame is stored once, transitions keep references.

Why: an Atari transition holds two 4x84x84 stacks (56 KB) that share 3 of
their 4 frames, and consecutive transitions of an env share 4 more, so a
buffer of stacked observations stores every frame about 8 times. Here each
frame goes once into a circular *frame pool*; a transition keeps the serial
numbers of its frames (int64 ``[stack]`` per stacked key) and its stacks are
gathered back on :meth:`FrameStackStorage.get`. Since a transition is rebuilt
from exactly the frames it was written with, stacks can never mix episodes,
and an n-step successor works like a 1-step one.

How frames are matched: first within the batch, by comparing the sub-stacks
that 1-step and n-step data repeat (see :mod:`components.replay.frame_match`,
the lock-free half of an extend); every frame left over is matched by content
within its env: each env keeps a small table of its most recently used frames
(crc32 of the frame bytes -> serial), and a hit is trusted only after a byte
comparison, so a crc collision costs one duplicate frame and never a wrong
observation.

Why a transition can become invalid: the pool is circular and has no
reference counts (cheap to write, nothing to free). A frame with serial ``s``
is gone once ``s < frames_written - frame_capacity``; a transition whose
oldest frame is gone cannot be rebuilt, :meth:`FrameStackStorage.valid_mask`
says so, and samplers skip it. The default pool (capacity + 1/8 + 64 stacks)
keeps every stored transition valid unless episodes are very short or there
are many more than 64 envs.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import MemoryMappedTensor, TensorDict, TensorDictBase

from components.obs_tree import ObsLeaf, frame_leaves
from components.replay.frame_match import FrameBatch, split_frames
from components.replay.storage import Key, TensorStorage, fsync_files, reserve_disk, to_tensordict

_REFS = "_frame_refs"  # per stacked key: the serials of its frames, int64 [stack]
_OLDEST = ("_frame_oldest",)  # the smallest serial a transition refers to


def _as_key(key: str | Sequence[str]) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


def tree_frame_keys(leaves: Sequence[ObsLeaf]) -> list[Key]:
    """The stacked keys of a Dict/Tuple observation: its image leaves (:func:`~components.obs_tree.frame_leaves`)
    under ``observation`` and ``("next", "observation")``, as batches nest them; its other leaves are stored whole.

    Examples:
        >>> import gymnasium as gym
        >>> from components.obs_tree import tree_leaves
        >>> leaves, _ = tree_leaves(gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (4, 84, 84), np.uint8),
        ...                                          "speed": gym.spaces.Box(-1, 1, (1,))}))
        >>> tree_frame_keys(leaves)
        [('observation', 'pixels'), ('next', 'observation', 'pixels')]
    """
    return [(*base, *leaf.key) for leaf in frame_leaves(leaves) for base in (("observation",), ("next", "observation"))]


def default_frame_capacity(capacity: int, stack: int) -> int:
    """Frames in the pool by default: one per transition, 1/8 spare for episode starts, 64 envs' stacks."""
    return capacity + capacity // 8 + 64 * stack


class FrameStackStorage:
    """Circular transition storage that keeps each distinct frame of stacked observations once.

    Same interface as :class:`~components.replay.storage.TensorStorage`; the
    stacked keys (``observation`` and ``("next", "observation")`` by default;
    a Dict observation's image leaves with :func:`tree_frame_keys`) must be
    ``[N, stack, *frame_shape]`` and every other key is stored as
    TensorStorage stores it. With ``path``, the frame pool
    (``path/frames.memmap``) and all per-transition fields
    (``path/transitions/``) are memory-mapped and reopen from
    :meth:`state_dict` like TensorStorage's.

    Args:
        capacity: the number of transitions kept.
        frame_capacity: frames in the pool; defaults to
            :func:`default_frame_capacity` (about 1.125 frames a transition).
        path: a directory for memory-mapped storage; ``None`` keeps it in RAM.
        frame_keys: the stacked keys whose frames are shared.
        env_key: the key naming each transition's env; frames are matched
            within one env only (absent: all transitions are one env).
        recent_frames: frames remembered per env for matching; must cover
            ``stack + n`` for n-step successors.
        device: must be the CPU (frames are matched with numpy); accepted so
            both storages take the same arguments.

    Examples:
        >>> s = FrameStackStorage(8)
        >>> f = torch.arange(6, dtype=torch.uint8).view(6, 1, 1).expand(6, 2, 2).clone()  # frames 0..5
        >>> obs = torch.stack([f[0:2], f[1:3], f[2:4]])      # stacks of 2 frames, 3 steps
        >>> nxt = torch.stack([f[1:3], f[2:4], f[3:5]])
        >>> batch = TensorDict({"observation": obs, "next": {"observation": nxt},
        ...                     "env_index": torch.zeros(3, dtype=torch.int64)}, [3])
        >>> s.extend(batch).tolist()
        [0, 1, 2]
        >>> s.frames_written                                   # 5 distinct frames, not 12
        5
        >>> bool((s.get([0, 1, 2])["next", "observation"] == nxt).all())
        True
    """

    may_invalidate = True

    def __init__(
        self,
        capacity: int,
        *,
        frame_capacity: int | None = None,
        path: str | Path | None = None,
        frame_keys: Sequence[str | Sequence[str]] = ("observation", ("next", "observation")),
        env_key: str | Sequence[str] = "env_index",
        recent_frames: int = 16,
        device: str | torch.device = "cpu",
    ) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"FrameStackStorage lives on the CPU (frames are matched with numpy), not on {device}")
        if frame_capacity is not None and frame_capacity < 1:
            raise ValueError(f"frame_capacity must be >= 1, got {frame_capacity}")
        self.capacity = int(capacity)
        self.path = Path(path) if path is not None else None
        self.frame_keys = [_as_key(k) for k in frame_keys]
        self.env_key = _as_key(env_key)
        self.recent_frames = int(recent_frames)
        self._requested_frame_capacity = frame_capacity
        self._rows = TensorStorage(capacity, path=self.path / "transitions" if self.path else None)
        self.frame_capacity: int | None = None
        self.stack: int | None = None
        self.frame_shape: tuple[int, ...] | None = None
        self.frame_dtype: torch.dtype | None = None
        self._pool: torch.Tensor | None = None
        self._pool_np: np.ndarray | None = None
        self._map: MemoryMappedTensor | None = None
        self._written = 0
        self._tables: dict[int, dict[int, int]] = {}

    # -- properties ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rows)

    @property
    def cursor(self) -> int:
        return self._rows.cursor

    @property
    def frames_written(self) -> int:
        """Distinct frames ever written (the serial the next new frame gets)."""
        return self._written

    @property
    def frame_bytes(self) -> int:
        """Bytes of the frame pool."""
        return self._laid_out().nbytes

    @property
    def frame_bytes_per_transition(self) -> float:
        """Frame pool bytes / capacity: about one frame per transition."""
        return self.frame_bytes / self.capacity

    @property
    def naive_bytes_per_transition(self) -> int:
        """What the stacked keys would take stored as they are (2 * stack * frame bytes for Atari)."""
        pool = self._laid_out()
        return len(self.frame_keys) * int(self.stack or 0) * pool[0].numel() * pool.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the frame pool plus all per-transition fields."""
        return self.frame_bytes + self._rows.nbytes

    def _laid_out(self) -> torch.Tensor:
        if self._pool is None:
            raise RuntimeError("the frame layout is taken from the first extend; nothing was written yet")
        return self._pool

    def __repr__(self) -> str:
        where = f"path={str(self.path)!r}" if self.path else "memory"
        return (f"{type(self).__name__}(capacity={self.capacity}, size={len(self)}, "
                f"frame_capacity={self.frame_capacity}, frames_written={self._written}, {where})")

    # -- writing ---------------------------------------------------------------------------------
    def extend(self, batch: TensorDictBase) -> torch.Tensor:
        """Write ``batch`` (batch size ``[N]``) at the cursor; returns the slots written (int64)."""
        return self.write(self.prepare(batch))

    def prepare(self, batch: TensorDictBase) -> FrameBatch:
        """Split off the stacked frames, match them within the batch, hash the rest (no shared state)."""
        return split_frames(batch, self.frame_keys, self.env_key, self.capacity)

    def write(self, prepared: FrameBatch) -> torch.Tensor:
        """Resolve every frame to a serial (an alias, a recent frame of its env, or a new one); store references."""
        p = prepared
        if self._pool is None:
            self._allocate(p.stack, p.frame_shape, p.dtype, create=True)
        self._check(p)
        pool, capacity, recent, stack = self._pool_np, int(self.frame_capacity), self.recent_frames, p.stack
        assert pool is not None
        written = self._written
        refs: list[list[list[int]]] = [[] for _ in self.frame_keys]  # per key, per kept row: serials
        oldest = np.full(p.rows, -1, dtype=np.int64)
        for r, i in enumerate(range(p.skip, p.rows)):
            table = self._tables.setdefault(int(p.envs[i]), {})
            row_min = None
            for k, stacked in enumerate(p.stacks):
                alias, crcs = p.aliases[k][r], p.crcs[k][r]
                serials: list[int] = []
                if alias is not None:
                    src_row, src_key, offset = alias
                    serials = refs[src_key][src_row - p.skip][offset:]
                    if min(serials, default=written) < written - capacity:  # lost to a tiny pool meanwhile
                        serials = []
                for j in range(len(serials), stack):
                    frame = stacked[i, j]
                    crc = crcs[j] if crcs[j] is not None else zlib.crc32(frame)
                    serial = table.pop(crc, None)  # re-inserted below: the table is least-recently-used
                    if (serial is None or serial < written - capacity
                            or pool[serial % capacity].tobytes() != frame.tobytes()):
                        serial = written
                        pool[serial % capacity] = frame
                        written += 1
                    table[crc] = serial
                    if len(table) > recent:
                        del table[next(iter(table))]
                    serials.append(serial)
                refs[k].append(serials)
                low = min(serials)
                row_min = low if row_min is None else min(row_min, low)
            oldest[i] = row_min
        self._written = written
        leaves = dict(p.leaves)
        for key, key_refs in zip(self.frame_keys, refs):
            full = np.full((p.rows, stack), -1, dtype=np.int64)
            if key_refs:
                full[p.skip :] = key_refs
            leaves[(_REFS, *key)] = torch.from_numpy(full)
        leaves[_OLDEST] = torch.from_numpy(oldest)
        return self._rows.write((leaves, p.rows))

    def _check(self, p: FrameBatch) -> None:
        if (p.stack, p.frame_shape, p.dtype) != (self.stack, self.frame_shape, self.frame_dtype):
            raise ValueError(f"got stacks of {p.stack} x {list(p.frame_shape)} {p.dtype}, the storage holds "
                             f"{self.stack} x {list(self.frame_shape or ())} {self.frame_dtype}")

    # -- reading ---------------------------------------------------------------------------------
    def valid_mask(self, indices: Any) -> torch.Tensor:
        """Which of ``indices`` can still be rebuilt (none of their frames overwritten in the pool)."""
        idx = self._rows.as_index(indices)
        if self._pool is None:
            return torch.ones(idx.numel(), dtype=torch.bool)
        return self._rows.field(_OLDEST)[idx] >= self._written - int(self.frame_capacity or 0)

    def get(self, indices: Any) -> TensorDict:
        """The transitions at ``indices`` with their stacks gathered back from the pool.

        Raises:
            IndexError: if one of them is invalid (see :meth:`valid_mask`): a
                wrong observation is never returned silently.
        """
        idx = self._rows.as_index(indices)
        leaves = self._rows.gather(idx)
        oldest = leaves.pop(_OLDEST)
        pool = self._laid_out()
        capacity = int(self.frame_capacity or 0)
        stale = oldest < self._written - capacity
        if bool(stale.any()):
            raise IndexError(f"transitions {idx[stale].tolist()[:8]} lost frames to the pool's wrap-around "
                             "(check valid_mask before get)")
        n = idx.numel()
        for key in self.frame_keys:
            refs = leaves.pop((_REFS, *key))
            leaves[key] = pool.index_select(0, (refs % capacity).reshape(-1)).view(n, *refs.shape[1:], *pool.shape[1:])
        return to_tensordict(leaves, n)

    def field(self, key: str | Sequence[str]) -> torch.Tensor:
        """A whole per-transition column (not the stacked keys: their frames are shared)."""
        key = _as_key(key)
        if key in self.frame_keys:
            raise KeyError(f"{key} is stored as shared frames; use get()")
        return self._rows.field(key)

    # -- allocation ------------------------------------------------------------------------------
    def _allocate(self, stack: int, frame_shape: tuple[int, ...], dtype: torch.dtype, *, create: bool) -> None:
        self.stack, self.frame_shape, self.frame_dtype = stack, frame_shape, dtype
        if self.frame_capacity is None:
            self.frame_capacity = self._requested_frame_capacity or default_frame_capacity(self.capacity, stack)
        shape = (self.frame_capacity, *frame_shape)
        if self.path is None:
            self._pool = torch.empty(shape, dtype=dtype)
        else:
            filename = self.path / "frames.memmap"
            self.path.mkdir(parents=True, exist_ok=True)
            if create:
                self._map = MemoryMappedTensor.empty(shape, dtype=dtype, filename=filename, existsok=True)
                reserve_disk(filename, self._map.numel() * self._map.element_size())
            else:
                if not filename.exists():
                    raise FileNotFoundError(f"cannot reopen the frame pool: {filename} is missing")
                self._map = MemoryMappedTensor.from_filename(filename, dtype, shape)
            self._pool = self._map.as_subclass(torch.Tensor)  # why a plain view: see storage.py
        self._pool_np = self._pool.numpy()

    # -- checkpointing ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Disk storage: make the frame pool and the per-transition files durable (see ``fsync_files``)."""
        self._rows.flush()
        if self.path is not None and self._map is not None:
            fsync_files([self.path / "frames.memmap"])

    def state_dict(self) -> dict[str, Any]:
        """Per-transition state, pool layout and the match tables; the frames too for memory storage.

        Disk storage is flushed first: the checkpoint must never outlive the frames it counts.
        """
        self.flush()
        state: dict[str, Any] = {
            "capacity": self.capacity,
            "frame_capacity": self.frame_capacity,
            "stack": self.stack,
            "frame_shape": list(self.frame_shape) if self.frame_shape is not None else None,
            "frame_dtype": str(self.frame_dtype).removeprefix("torch.") if self.frame_dtype else None,
            "frames_written": self._written,
            "tables": {env: list(table.items()) for env, table in self._tables.items()},
            "rows": self._rows.state_dict(),
            "path": str(self.path) if self.path is not None else None,
            "frames": None,
        }
        if self.path is None and self._pool is not None:
            state["frames"] = self._pool[: min(self._written, int(self.frame_capacity or 0))].clone()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; disk storage maps the files under its own ``path``."""
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"state_dict is for capacity {state['capacity']}, this storage has {self.capacity}")
        frames = state.get("frames")
        if state.get("stack") is not None and frames is None and self.path is None:
            raise ValueError(f"this state_dict comes from a disk storage (path={state.get('path')}); "
                             f"build FrameStackStorage({self.capacity}, path=...) to reopen its files")
        self._rows.load_state_dict(state["rows"])
        self._written = int(state["frames_written"])
        self._tables = {int(env): {int(c): int(s) for c, s in table} for env, table in state["tables"].items()}
        self._pool = self._pool_np = self._map = None
        self.frame_capacity = self.stack = self.frame_shape = self.frame_dtype = None
        if state.get("stack") is None:
            return
        self.frame_capacity = int(state["frame_capacity"])
        self._allocate(int(state["stack"]), tuple(state["frame_shape"]), getattr(torch, state["frame_dtype"]),
                       create=frames is not None)
        if frames is not None:
            self._laid_out()[: frames.shape[0]].copy_(frames)
