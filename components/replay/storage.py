"""Fixed-capacity circular storage of transitions, in memory or memory-mapped on disk.

Why preallocated leaves instead of a growing list of batches: a replay buffer
is written a batch at a time and read a random row at a time, so it must be
one array per field that a gather can index in one call. The layout (keys,
per-row shapes, dtypes) is taken from the first batch, so nothing has to be
declared up front.

Why ``as_subclass(torch.Tensor)`` on the memory-mapped leaves: a
``MemoryMappedTensor`` routes every op through ``__torch_function__`` (tens to
hundreds of microseconds per slice copy, depending on the tensordict
version); a plain tensor view of the same mapped storage costs a few
microseconds and keeps the mapping alive for as long as it lives.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tensordict import MemoryMappedTensor, TensorDict, TensorDictBase

#: A nested key, always as a tuple (``("next", "observation")``, ``("action",)``).
Key = tuple[str, ...]


@dataclass(frozen=True)
class Leaf:
    """One stored field: its nested key, the shape of one row, and its dtype.

    Examples:
        >>> Leaf(("next", "reward"), (), torch.float32).row_bytes
        4
    """

    key: Key
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()

    def to_state(self) -> tuple[list[str], list[int], str]:
        return list(self.key), list(self.shape), str(self.dtype).removeprefix("torch.")

    @classmethod
    def from_state(cls, state: Iterable[Any]) -> Leaf:
        key, shape, dtype = state
        return cls(tuple(key), tuple(int(d) for d in shape), getattr(torch, dtype))


def leaves_of(batch: TensorDictBase) -> dict[Key, torch.Tensor]:
    """The tensor leaves of ``batch`` under tuple keys (nested keys flattened)."""
    out: dict[Key, torch.Tensor] = {}
    for key, value in batch.items(include_nested=True, leaves_only=True):
        key = (key,) if isinstance(key, str) else tuple(key)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"replay stores tensors only; {key} holds a {type(value).__name__}")
        out[key] = value
    return out


def to_tensordict(leaves: Mapping[Key, torch.Tensor], rows: int, device: Any = None) -> TensorDict:
    """Build a TensorDict of batch size ``[rows]`` from tuple-keyed leaves."""
    tree: dict[str, Any] = {}
    for key, value in leaves.items():
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return TensorDict(tree, batch_size=[rows], device=device)


def reserve_disk(filename: str | Path, nbytes: int) -> None:
    """Allocate a memory-mapped file's blocks now.

    A memory map over a sparse file fails on a full disk with SIGBUS at some
    later write, which kills the process without a word; allocating up front
    turns that into an ``OSError`` (ENOSPC) here, at start-up.
    """
    if not hasattr(os, "posix_fallocate") or nbytes <= 0:
        return
    fd = os.open(filename, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it: keep the sparse file
            return
        raise OSError(err.errno, f"cannot reserve {nbytes / 1e9:.2f} GB for {filename}: {err.strerror}") from None
    finally:
        os.close(fd)


def fsync_files(filenames: Iterable[str | Path]) -> None:
    """Make what was written through memory maps of ``filenames`` durable: fsync each file, then its directory.

    Rows written into a ``MAP_SHARED`` mapping sit in the page cache: they
    survive the process (a SIGKILL) but not a power cut or a kernel crash
    until written back. A checkpoint that refers to those rows (cursor,
    size, priorities) must not become durable before them, or a resumed run
    samples rows the checkpoint says exist but the disk never received.
    On Linux ``fsync`` on any descriptor of the file writes back the pages
    dirtied through the mapping too (what ``msync``/``np.memmap.flush`` do).
    """
    from components.atomic_files import fsync_dir

    directories: dict[Path, None] = {}
    for filename in filenames:
        fd = os.open(filename, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        directories[Path(filename).parent] = None
    for directory in directories:
        fsync_dir(directory)  # the files' names too (created at the first extend)


def rows_of(batch: TensorDictBase) -> int:
    """The number of transitions in ``batch``; it must have exactly one batch dim."""
    if batch.batch_dims != 1:
        raise ValueError(
            f"replay stores batches with one batch dimension, got batch_size {list(batch.batch_size)}; "
            "flatten it first (batch.reshape(-1))"
        )
    return int(batch.batch_size[0])


class Storage(Protocol):
    """What :class:`~components.replay.buffer.ReplayBuffer` needs from a storage.

    ``prepare`` does the work that needs no shared state (validation, device
    moves, hashing) so the buffer can run it outside its lock; ``write`` is the
    part that mutates the storage.
    """

    capacity: int
    may_invalidate: bool

    def __len__(self) -> int: ...
    def prepare(self, batch: TensorDictBase) -> Any: ...
    def write(self, prepared: Any) -> torch.Tensor: ...
    def get(self, indices: Any) -> TensorDict: ...
    def field(self, key: str | Key) -> torch.Tensor: ...
    def valid_mask(self, indices: Any) -> torch.Tensor: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class TensorStorage:
    """Preallocated circular storage of transitions: plain tensors, or memmaps under ``path``.

    Rows are written at the cursor and overwrite the oldest ones once the
    storage is full; extending with ``n`` rows always has the same effect as
    ``n`` one-row extends (a batch larger than the capacity keeps its last
    ``capacity`` rows). Each extend costs one contiguous copy per leaf (two
    when the batch wraps around the end).

    With ``path``, every leaf is a memory-mapped file ``path/<key parts>.memmap``
    so the buffer may exceed RAM; the data lives in the files, and a new
    ``TensorStorage(capacity, path=path)`` given the saved :meth:`state_dict`
    maps them again. Without ``path``, :meth:`state_dict` carries the data.
    Because disk rows are not copied, a disk checkpoint is only exact if no
    extend happens between taking the state_dict and the end of the run (or
    the copy of the directory): pause the writer, save, then resume.

    Args:
        capacity: the number of transitions kept.
        device: where memory storage lives (disk storage is always CPU).
        path: a directory for memory-mapped leaves; ``None`` keeps them in RAM.

    Examples:
        >>> s = TensorStorage(4)
        >>> batch = TensorDict({"obs": torch.arange(6.0), "next": {"reward": -torch.arange(6.0)}}, [6])
        >>> s.extend(batch).tolist()      # 6 rows into 4 slots: rows 2..5 land as 2 one-row extends would
        [2, 3, 0, 1]
        >>> len(s), s.cursor
        (4, 2)
        >>> s.get([0, 2])["next", "reward"].tolist()
        [-4.0, -2.0]
    """

    may_invalidate = False

    def __init__(self, capacity: int, *, device: str | torch.device = "cpu", path: str | Path | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.path = Path(path) if path is not None else None
        if self.path is not None and self.device.type != "cpu":
            raise ValueError(f"disk storage (path={self.path}) lives on the CPU, not on {self.device}")
        self.layout: list[Leaf] | None = None
        self._leaves: dict[Key, torch.Tensor] = {}
        self._maps: list[MemoryMappedTensor] = []
        self._files: list[Path] = []  # the memory-mapped files (disk storage), flushed before each state_dict
        self._cursor = 0
        self._size = 0

    # -- properties ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._size

    @property
    def cursor(self) -> int:
        """The slot the next row goes to (the oldest row once the storage is full)."""
        return self._cursor

    @property
    def nbytes(self) -> int:
        """Bytes allocated for all leaves (0 before the first extend)."""
        return sum(leaf.row_bytes for leaf in self.layout or []) * self.capacity

    def __repr__(self) -> str:
        where = f"path={str(self.path)!r}" if self.path else f"device={self.device}"
        return f"{type(self).__name__}(capacity={self.capacity}, size={self._size}, {where})"

    # -- writing ---------------------------------------------------------------------------------
    def extend(self, batch: TensorDictBase) -> torch.Tensor:
        """Write ``batch`` (batch size ``[N]``) at the cursor; returns the slots written (int64)."""
        return self.write(self.prepare(batch))

    def prepare(self, batch: TensorDictBase) -> tuple[dict[Key, torch.Tensor], int]:
        """The leaves of ``batch`` on this storage's device (no shared state touched)."""
        rows = rows_of(batch)
        leaves = leaves_of(batch)
        if self.device.type != "cpu" or any(v.device != self.device for v in leaves.values()):
            leaves = {k: v.to(self.device) for k, v in leaves.items()}
        return leaves, rows

    def write(self, prepared: tuple[dict[Key, torch.Tensor], int]) -> torch.Tensor:
        """Copy prepared leaves into the circular storage; returns the slots written."""
        leaves, rows = prepared
        if self.layout is None:
            self._allocate([Leaf(k, tuple(v.shape[1:]), v.dtype) for k, v in leaves.items()], create=True)
        self._check(leaves, rows)
        kept = min(rows, self.capacity)
        skip = rows - kept
        start = (self._cursor + skip) % self.capacity
        first = min(kept, self.capacity - start)
        for key, dst in self._leaves.items():
            src = leaves[key]
            if skip:
                src = src[skip:]
            dst[start : start + first].copy_(src[:first])
            if first < kept:
                dst[: kept - first].copy_(src[first:])
        self._cursor = (start + kept) % self.capacity
        self._size = min(self._size + kept, self.capacity)
        return (torch.arange(start, start + kept, dtype=torch.int64) % self.capacity).to(self.device)

    def _check(self, leaves: Mapping[Key, torch.Tensor], rows: int) -> None:
        if leaves.keys() != self._leaves.keys():
            missing = sorted(set(self._leaves) - set(leaves))
            extra = sorted(set(leaves) - set(self._leaves))
            raise KeyError(f"batch keys differ from the stored layout: missing {missing}, unexpected {extra}")
        for leaf in self.layout or []:
            value = leaves[leaf.key]
            if tuple(value.shape[1:]) != leaf.shape or value.shape[0] != rows:
                raise ValueError(
                    f"{leaf.key}: got shape {list(value.shape)}, the storage holds [{rows}, *{list(leaf.shape)}]"
                )

    # -- reading ---------------------------------------------------------------------------------
    def get(self, indices: Any) -> TensorDict:
        """The rows at ``indices`` (a list, array or int64 tensor of slots < ``len(self)``)."""
        idx = self.as_index(indices)
        return to_tensordict(self.gather(idx), idx.numel(), self.device)

    def gather(self, idx: torch.Tensor) -> dict[Key, torch.Tensor]:
        """The rows at ``idx`` as tuple-keyed leaves (one advanced-index gather per leaf)."""
        return {key: value[idx] for key, value in self._leaves.items()}

    def as_index(self, indices: Any) -> torch.Tensor:
        """``indices`` as a flat int64 tensor on this storage's device, checked against ``len(self)``."""
        idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self._size):
            raise IndexError(f"indices must lie in [0, {self._size}), got {int(idx.min())}..{int(idx.max())}")
        return idx.to(self.device)

    def field(self, key: str | Key) -> torch.Tensor:
        """The whole stored column ``key`` (``capacity`` rows; rows >= ``len(self)`` are unset)."""
        key = (key,) if isinstance(key, str) else tuple(key)
        if key not in self._leaves:
            raise KeyError(f"the storage holds no {key}; it holds {sorted(self._leaves)}")
        return self._leaves[key]

    def valid_mask(self, indices: Any) -> torch.Tensor:
        """Every stored row of a plain storage can be read back."""
        return torch.ones(torch.as_tensor(indices).numel(), dtype=torch.bool)

    # -- allocation ------------------------------------------------------------------------------
    def _allocate(self, layout: list[Leaf], *, create: bool) -> None:
        self.layout = layout
        self._leaves = {}
        self._maps = []
        self._files = []
        for leaf in layout:
            shape = (self.capacity, *leaf.shape)
            if self.path is None:
                # empty, not zeros: untouched pages cost no RAM until rows are written.
                self._leaves[leaf.key] = torch.empty(shape, dtype=leaf.dtype, device=self.device)
            else:
                self._leaves[leaf.key] = self._map(leaf, shape, create)

    def _map(self, leaf: Leaf, shape: tuple[int, ...], create: bool) -> torch.Tensor:
        assert self.path is not None
        if any(not part or part in (".", "..") or os.sep in part for part in leaf.key):
            raise ValueError(f"key {leaf.key} cannot name a file under {self.path}")
        filename = self.path.joinpath(*leaf.key[:-1], leaf.key[-1] + ".memmap")
        nbytes = leaf.row_bytes * self.capacity
        if create:
            filename.parent.mkdir(parents=True, exist_ok=True)
            mapped = MemoryMappedTensor.empty(shape, dtype=leaf.dtype, filename=filename, existsok=True)
            reserve_disk(filename, nbytes)
        else:
            if not filename.exists() or filename.stat().st_size < nbytes:
                raise FileNotFoundError(
                    f"cannot reopen {leaf.key}: {filename} is missing or shorter than {nbytes} bytes"
                )
            mapped = MemoryMappedTensor.from_filename(filename, leaf.dtype, shape)
        self._maps.append(mapped)
        self._files.append(filename)
        return mapped.as_subclass(torch.Tensor)

    # -- checkpointing ---------------------------------------------------------------------------
    def flush(self) -> None:
        """Disk storage: make every row written so far durable (:func:`fsync_files`); a no-op in memory."""
        fsync_files(self._files)

    def state_dict(self) -> dict[str, Any]:
        """Cursor, size and layout; the rows too for memory storage (disk rows stay in the files, flushed first)."""
        self.flush()  # the checkpoint that carries this state must never outlive the rows it counts
        state: dict[str, Any] = {
            "capacity": self.capacity,
            "cursor": self._cursor,
            "size": self._size,
            "layout": [leaf.to_state() for leaf in self.layout] if self.layout is not None else None,
            "path": str(self.path) if self.path is not None else None,
            "data": None,
        }
        if self.path is None and self.layout is not None:
            state["data"] = [self._leaves[leaf.key][: self._size].to("cpu", copy=True) for leaf in self.layout]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; disk storage maps the files under its own ``path``."""
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"state_dict is for capacity {state['capacity']}, this storage has {self.capacity}")
        data = state.get("data")
        if data is None and state.get("layout") is not None and self.path is None:
            raise ValueError(
                f"this state_dict comes from a disk storage (path={state.get('path')}) and holds no rows; "
                f"build TensorStorage({self.capacity}, path=...) to reopen its files"
            )
        self._cursor, self._size = int(state["cursor"]), int(state["size"])
        if state.get("layout") is None:
            self.layout, self._leaves, self._maps, self._files = None, {}, [], []
            return
        layout = [Leaf.from_state(entry) for entry in state["layout"]]
        self._allocate(layout, create=data is not None)
        if data is not None:
            for leaf, rows in zip(layout, data):
                self._leaves[leaf.key][: rows.shape[0]].copy_(rows)
