"""Shared memory arenas: one anonymous shared block carved into named arrays.

Why not ``torch.Tensor.share_memory_()``: every shared tensor costs a file
descriptor, and unpickling one forces ``import torch`` (about 1.5 s) in env
worker processes that only need numpy. Why not
``multiprocessing.shared_memory``: named segments outlive a SIGKILLed owner
unless a tracker process cleans them up. An arena is one ``memfd`` (an
unlinked temporary file where ``memfd_create`` is missing) passed to children
as a file descriptor, so the kernel frees it when the last process holding it
exits, however that process ends.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import numpy as np

_ALIGN = 64  # cache-line alignment: no two arrays share a line


@dataclass(frozen=True)
class FieldSpec:
    """Shape and dtype of one named array (the leading dims included).

    Examples:
        >>> FieldSpec("observation", (8, 4), "float32").nbytes
        128
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def with_leading(self, *dims: int) -> FieldSpec:
        """The same field with extra leading dimensions (e.g. slots, rows)."""
        return FieldSpec(self.name, (*dims, *self.shape), self.dtype)


#: bytes between two writers' entries of a per-worker field: a cache line and the one the CPU prefetches with it
LANE_BYTES = 128


def lane_field(name: str, writers: int, dtype: str, width: int = 1) -> FieldSpec:
    """A per-writer field (``width`` values each) whose writers' rows lie :data:`LANE_BYTES` apart.

    Counters that each worker process updates every step, packed side by
    side, share cache lines: every write by one worker takes the line from
    the other's core (false sharing), a cache miss per write on both sides.
    Read it through :func:`lanes`, which has the packed field's shape.

    Examples:
        >>> lane_field("beats", 2, "int64").shape, lane_field("timing", 2, "float64", 7).shape
        ((2, 16), (2, 16))
    """
    per_lane = LANE_BYTES // np.dtype(dtype).itemsize
    return FieldSpec(name, (writers, -(-width // per_lane) * per_lane), dtype)


def lanes(array: np.ndarray, width: int | None = None) -> np.ndarray:
    """The view of a :func:`lane_field` array as the packed field: ``[writers]``, or ``[writers, width]``."""
    return array[:, 0] if width is None else array[:, :width]


def _layout(fields: Iterable[FieldSpec]) -> tuple[dict[str, tuple[int, FieldSpec]], int]:
    offsets: dict[str, tuple[int, FieldSpec]] = {}
    offset = 0
    for spec in fields:
        if spec.name in offsets:
            raise ValueError(f"duplicate arena field {spec.name!r}")
        offsets[spec.name] = (offset, spec)
        offset += -(-spec.nbytes // _ALIGN) * _ALIGN
    return offsets, max(offset, _ALIGN)


def _anonymous_fd(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("rlpipeline-arena", getattr(os, "MFD_CLOEXEC", 0))
    else:  # pragma: no cover - non-Linux POSIX
        fd, path = tempfile.mkstemp(prefix="rlpipeline-arena-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


class SharedArena:
    """Named numpy (and torch) arrays over one block of process-shared memory.

    Pickling an arena (e.g. as an argument of a spawned process) passes its
    file descriptor; the child maps the same pages, so writes on either side
    are visible to the other without copies or messages.

    Examples:
        >>> arena = SharedArena([FieldSpec("x", (2, 3), "float32")])
        >>> arena.array("x")[:] = 1.0
        >>> float(arena.tensor("x").sum())
        6.0
    """

    def __init__(self, fields: Iterable[FieldSpec], *, _fd: int | None = None) -> None:
        self._offsets, self._size = _layout(fields)
        self._fd = _anonymous_fd(self._size) if _fd is None else _fd
        self._map = mmap.mmap(self._fd, self._size)
        self._arrays: dict[str, np.ndarray] = {}
        for name, (offset, spec) in self._offsets.items():
            count = int(np.prod(spec.shape, dtype=np.int64))
            array = np.frombuffer(self._map, dtype=spec.dtype, count=count, offset=offset)
            self._arrays[name] = array.reshape(spec.shape)

    @property
    def fields(self) -> list[FieldSpec]:
        return [spec for _, spec in self._offsets.values()]

    @property
    def nbytes(self) -> int:
        return self._size

    def __contains__(self, name: str) -> bool:
        return name in self._arrays

    def array(self, name: str) -> np.ndarray:
        """The shared numpy view of field ``name``."""
        return self._arrays[name]

    def arrays(self) -> Mapping[str, np.ndarray]:
        return self._arrays

    def tensor(self, name: str) -> Any:
        """A torch view sharing memory with :meth:`array` (imports torch lazily)."""
        import torch

        return torch.from_numpy(self._arrays[name])

    def tensors(self) -> dict[str, Any]:
        return {name: self.tensor(name) for name in self._arrays}

    def close(self) -> None:
        """Release this process's descriptor; the pages live while any view does."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __reduce__(self):
        if self._fd < 0:
            raise RuntimeError("cannot pickle a closed SharedArena")
        return _rebuild_arena, (reduction.DupFd(self._fd), self.fields)


def _rebuild_arena(dup_fd: Any, fields: list[FieldSpec]) -> SharedArena:
    return SharedArena(fields, _fd=dup_fd.detach())
