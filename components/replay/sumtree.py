"""A sum tree with a parallel min tree, vectorised over whole batches (numpy, float64).

Why numpy and not a Python loop per item: prioritized replay updates and
samples hundreds of items per training step, so each operation walks the tree
once per *level* for the whole batch (about 20 numpy calls for a million
leaves) instead of once per item. Why float64: sums of a million priorities
in float32 lose the small ones.

Why interior nodes are recomputed from their children rather than adjusted by
deltas: deltas accumulate rounding error over millions of updates, a
recomputation never drifts.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class SumTree:
    """Non-negative values on ``capacity`` leaves with O(log n) batched update, prefix search and min.

    A leaf of value 0 is *absent*: it is never found by :meth:`find` and does
    not count towards :attr:`min` (the smallest positive value, which sets the
    largest importance weight of prioritized replay).

    Args:
        capacity: the number of leaves.

    Examples:
        >>> tree = SumTree(4)
        >>> tree.update([0, 1, 2], [1.0, 2.0, 3.0])
        >>> tree.total, tree.min
        (6.0, 1.0)
        >>> tree.find([0.0, 0.99, 1.0, 2.5, 5.99]).tolist()   # leaf i covers [sum_{j<i}, sum_{j<=i})
        [0, 0, 1, 1, 2]
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._depth = max(1, (self.capacity - 1).bit_length())
        self._base = 1 << self._depth  # leaf i lives at node base + i; node 1 is the root
        self._sums = np.zeros(2 * self._base, dtype=np.float64)
        self._mins = np.full(2 * self._base, np.inf, dtype=np.float64)

    @property
    def total(self) -> float:
        """The sum of all leaves."""
        return float(self._sums[1])

    @property
    def min(self) -> float:
        """The smallest positive leaf (``inf`` when every leaf is 0)."""
        return float(self._mins[1])

    def __getitem__(self, indices: Any) -> np.ndarray:
        return self._sums[self._base + self._leaf_index(indices)]

    @property
    def values(self) -> np.ndarray:
        """A read-only view of all ``capacity`` leaves."""
        view = self._sums[self._base : self._base + self.capacity]
        view.flags.writeable = False
        return view

    def _leaf_index(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            raise IndexError(f"leaf indices must lie in [0, {self.capacity}), got {idx.min()}..{idx.max()}")
        return idx

    def update(self, indices: Any, values: Any) -> None:
        """Set leaves ``indices`` to ``values`` (a scalar or one value each; the last of duplicates wins)."""
        idx = self._leaf_index(indices)
        vals = np.broadcast_to(np.asarray(values, dtype=np.float64).reshape(-1), idx.shape)
        if vals.size and (not np.all(np.isfinite(vals)) or vals.min() < 0):
            raise ValueError("sum-tree values must be finite and >= 0")
        nodes = idx + self._base
        self._sums[nodes] = vals
        self._mins[nodes] = np.where(vals > 0, vals, np.inf)
        # Duplicate parents just recompute the same value twice, which is cheaper than np.unique.
        for _ in range(self._depth):
            nodes >>= 1
            left = 2 * nodes
            self._sums[nodes] = self._sums[left] + self._sums[left + 1]
            self._mins[nodes] = np.minimum(self._mins[left], self._mins[left + 1])

    def set_all(self, values: Any) -> None:
        """Replace every leaf at once (a level-by-level rebuild, for checkpoints)."""
        vals = np.asarray(values, dtype=np.float64).reshape(-1)
        if vals.shape != (self.capacity,):
            raise ValueError(f"expected {self.capacity} values, got {vals.shape[0]}")
        self._sums[:] = 0.0
        self._mins[:] = np.inf
        self._sums[self._base : self._base + self.capacity] = vals
        self._mins[self._base : self._base + self.capacity] = np.where(vals > 0, vals, np.inf)
        lo = self._base
        while lo > 1:
            lo //= 2
            parents = np.arange(lo, 2 * lo)
            self._sums[parents] = self._sums[2 * parents] + self._sums[2 * parents + 1]
            self._mins[parents] = np.minimum(self._mins[2 * parents], self._mins[2 * parents + 1])

    def find(self, prefix_sums: Any) -> np.ndarray:
        """For each prefix sum ``s`` in ``[0, total)``, the leaf ``i`` with ``sum_{j<i} <= s < sum_{j<=i}``.

        A descent never enters a subtree whose sum is 0, so rounding at the
        top of the range can never return an absent leaf.
        """
        if self._sums[1] <= 0:
            raise ValueError("cannot search an empty sum tree (every leaf is 0)")
        s = np.clip(np.asarray(prefix_sums, dtype=np.float64).reshape(-1), 0.0, self._sums[1])
        nodes = np.ones(s.shape, dtype=np.int64)
        for _ in range(self._depth):
            left = 2 * nodes
            left_sum = self._sums[left]
            right = (s >= left_sum) & (self._sums[left + 1] > 0)
            s = np.where(right, s - left_sum, s)
            nodes = left + right
        return nodes - self._base
