"""Memory for the batches the driver assembles, given back when the consumer lets a batch go.

A fresh ``torch.empty`` of a big field is fresh pages: the kernel faults and
zeroes each one on first write, which costs four to five times the copy that
fills it (measured: 103 MB of 210x160x3 frames, 60-72 ms into new memory
against 11-14 ms into memory used before). With two observation leaves per
transition that made the driver, not the envs, the bottleneck of a
big-observation run (0.76 of a CPU at 4,946 frames/s). Big fields therefore
come from buffers that return to a free list when the last tensor (or view)
of a batch that used them is gone, so a trainer that keeps a batch keeps its
memory, and one that drops it hands the pages back already faulted in.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

#: Fields smaller than this come from torch's allocator (its small blocks are reused already).
MIN_POOLED_BYTES = 1 << 20
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {}


class BatchMemory:
    """Buffers by (shape, dtype): ``empty`` hands one out, its return is automatic.

    ``keep``: free buffers kept per (shape, dtype); more are freed (a
    consumer that drops batches in bursts does not pin memory for good).
    """

    def __init__(self, keep: int = 2, min_bytes: int = MIN_POOLED_BYTES) -> None:
        self._free: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        self.keep = int(keep)
        self.min_bytes = int(min_bytes)
        #: buffers allocated (for tests and the profile: reuse means this stops growing)
        self.allocated = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor; big ones from a recycled buffer."""
        np_dtype = _NUMPY_DTYPES.get(dtype)
        if np_dtype is None:
            np_dtype = _NUMPY_DTYPES[dtype] = torch.empty((), dtype=dtype).numpy().dtype
        if math.prod(shape) * np_dtype.itemsize < self.min_bytes:  # (np.prod: ~4 us a call)
            return torch.empty(shape, dtype=dtype)
        key = (tuple(int(d) for d in shape), np_dtype.str)
        free = self._free.setdefault(key, [])
        try:
            base = free.pop()
        except IndexError:
            base = np.empty(key[0], np_dtype)
            self.allocated += 1
        # A view per hand-out: when torch lets go of it (every tensor and view of the batch field is
        # gone), the finaliser puts the buffer back; the free list holds the only other reference.
        view = base.view()
        weakref.finalize(view, self._give_back, key, base)
        return torch.from_numpy(view)

    def _give_back(self, key: tuple[tuple[int, ...], str], base: np.ndarray) -> None:
        free = self._free.setdefault(key, [])
        if len(free) < self.keep:
            free.append(base)

    def free_buffers(self) -> int:
        return sum(len(v) for v in self._free.values())

