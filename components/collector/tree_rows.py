"""How an env block writes Dict/Tuple observations into packed rows, each leaf held to its spec.

The env block's one-leaf fast path compares an observation's type, shape and
dtype and writes it; a tree does the same per leaf, into that leaf's view of
the packed rows (:func:`components.obs_tree.leaf_view`), so a Dict
observation costs one compare and one numpy assignment per leaf per env. A
leaf that is missing or off its space is an :class:`OffSpec` naming the
leaf; the block adds the env and the step. The finiteness, category and
action-mask checks read the leaves they apply to, once per block step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from components.action_masks import first_empty, mask_segments
from components.collector.spec_checks import OffSpec, check_observation
from components.envs import EnvSpec
from components.obs_tree import ObsLeaf, leaf_value, leaf_view


def _leaf_spec(leaf: ObsLeaf) -> EnvSpec:
    """A one-leaf spec of ``leaf`` (what the one-leaf checks take)."""
    return EnvSpec(leaf.shape, leaf.dtype, "discrete", action_n=1, obs_kind=leaf.kind, obs_nvec=leaf.nvec,
                   obs_start=leaf.start)


class TreeRows:
    """Writes and checks the leaves of ``spec``'s observation tree in packed ``[envs, packed]`` rows."""

    def __init__(self, spec: EnvSpec) -> None:
        self.leaves: tuple[ObsLeaf, ...] = spec.obs_leaves
        self._fast = [(leaf.path, tuple(leaf.shape), np.dtype(leaf.dtype),
                       leaf.shape == () and np.dtype(leaf.dtype).kind in "iu") for leaf in self.leaves]
        self._specs = [_leaf_spec(leaf) for leaf in self.leaves]
        self._float = [k for k, leaf in enumerate(self.leaves) if np.dtype(leaf.dtype).kind == "f"]
        self._categories = []
        for k, leaf in enumerate(self.leaves):
            if leaf.categorical:
                low = np.asarray(leaf.start, np.int64).reshape(leaf.shape)
                self._categories.append((k, low, low + np.asarray(leaf.nvec, np.int64).reshape(leaf.shape)))
        self._mask: int | None = None
        self._segments: list[tuple[int, int]] = []
        if spec.action_mask is not None:
            self._mask = next(k for k, leaf in enumerate(self.leaves) if leaf.name == spec.action_mask)
            self._segments = mask_segments(spec)

    @property
    def has_float(self) -> bool:
        return bool(self._float)

    @property
    def has_categories(self) -> bool:
        return bool(self._categories)

    @property
    def has_mask(self) -> bool:
        return self._mask is not None

    def views(self, rows: np.ndarray) -> list[np.ndarray]:
        """Every leaf's view of ``rows`` (once per block step, per array written)."""
        return [leaf_view(rows, leaf) for leaf in self.leaves]

    def write(self, views: Sequence[np.ndarray], i: int, obs: Any) -> None:
        """Env ``i``'s observation tree into row ``i`` of ``views``; :class:`OffSpec` naming the leaf if it is off."""
        if not isinstance(obs, (Mapping, tuple, list)):
            raise OffSpec(f"its observation is a {type(obs).__name__}; the observation space promises a "
                          f"{'Dict' if isinstance(self.leaves[0].path[0], str) else 'Tuple'} with leaves "
                          f"{', '.join(leaf.name for leaf in self.leaves)}")
        ndarray = np.ndarray
        for k, (path, shape, dtype, int_scalar) in enumerate(self._fast):
            try:
                value = leaf_value(obs, path)
            except (KeyError, IndexError, TypeError):
                raise OffSpec(f"its observation has no leaf {self.leaves[k].name!r}; the observation space "
                              f"promises {', '.join(leaf.name for leaf in self.leaves)}") from None
            if (type(value) is ndarray and value.shape == shape and value.dtype is dtype) or (
                    int_scalar and type(value) is int):
                views[k][i] = value
                continue
            try:
                views[k][i] = check_observation(value, self._specs[k])
            except OffSpec as err:
                raise OffSpec(str(err).replace("its observation", f"its observation leaf {self.leaves[k].name!r}",
                                               1)) from None

    def finite(self, rows: np.ndarray) -> bool:
        """Every float leaf of ``rows`` is finite (one reduction per float leaf)."""
        add = np.add.reduce
        return all(np.isfinite(add(leaf_view(rows, self.leaves[k]), None)) for k in self._float)

    def non_finite_rows(self, rows: np.ndarray) -> np.ndarray:
        bad = np.zeros(len(rows), bool)
        for k in self._float:
            bad |= ~np.isfinite(leaf_view(rows, self.leaves[k]).reshape(len(rows), -1)).all(axis=1)
        return bad

    def outside_categories(self, rows: np.ndarray) -> tuple[int, str] | None:
        """``(row, message)`` of the first categorical leaf value outside its space's categories, or None."""
        for k, low, high in self._categories:
            values = leaf_view(rows, self.leaves[k])
            outside = ((values < low) | (values >= high)).reshape(len(rows), -1).any(axis=1)
            if outside.any():
                row = int(np.flatnonzero(outside)[0])
                return row, (f"its observation leaf {self.leaves[k].name!r} {values[row].tolist()} is outside the "
                             f"space's categories (from {low.tolist()}, {(high - low).tolist()} of each)")
        return None

    def empty_mask(self, rows: np.ndarray) -> int | None:
        """The first row whose action mask allows nothing (in some component), or None."""
        if self._mask is None:
            return None
        masks = leaf_view(rows, self.leaves[self._mask]).reshape(len(rows), -1)
        return first_empty(masks != 0, self._segments)
