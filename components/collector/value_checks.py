"""What a block's observations must hold beyond their type and shape, checked once per block step.

A categorical observation (``Discrete``, ``MultiDiscrete``, or such a leaf
of a ``Dict``/``Tuple``) must lie inside its space's categories: a value
outside would index past a one-hot encoder, in the policy's process, far
from the env that returned it. An observation the policy acts on must
leave its action mask some action: an all-false mask would be a NaN in the
policy. Either is the env's spec violation, named here with the env and
the step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from components.collector.spec_checks import OffSpec, violation


class ObservationValues:
    """The category and action-mask checks of one block's observations (:attr:`active`: any to make)."""

    def __init__(self, spec: Any, tree: Any, env_ids: np.ndarray) -> None:
        self.spec, self.tree, self.env_ids = spec, tree, env_ids
        #: per component of a flat categorical observation: its first category and one past its last
        self.categories: tuple[np.ndarray, np.ndarray] | None = None
        if tree is None and spec.categorical_obs:
            shape = tuple(spec.obs_shape)
            low = np.asarray(spec.obs_start, np.int64).reshape(shape)
            self.categories = (low, low + np.asarray(spec.obs_nvec, np.int64).reshape(shape))
        self.has_mask = tree is not None and tree.has_mask
        self.active = self.categories is not None or (tree is not None and (tree.has_categories or tree.has_mask))

    def check(self, obs: np.ndarray, when: str | None, env_step: np.ndarray, first: int = 0,
              masks: bool = True) -> None:
        """Rows ``first:`` of the block in ``obs``; ``when`` None: during the step under way (``env_step`` + 1).

        ``masks``: the observations are ones the policy acts on, so their
        action masks are checked too.
        """
        if self.tree is not None:
            self.check_tree(obs, when, env_step, first, masks)
            return
        assert self.categories is not None
        low, high = self.categories
        outside = (obs < low) | (obs >= high)
        if not outside.any():
            return
        i = first + int(np.flatnonzero(outside.reshape(len(obs), -1).any(axis=1))[0])
        value = obs[i - first]
        err = OffSpec(f"its observation {value.tolist()} is outside the space's categories "
                      f"(from {low.tolist()}, {(high - low).tolist()} of each)")
        at = when if when is not None else f"at its step {int(env_step[i]) + 1}"
        raise violation(int(self.env_ids[i]), at, err)

    def check_tree(self, obs: np.ndarray, when: str | None, env_step: np.ndarray, first: int, masks: bool,
                   categories: bool = True) -> None:
        """A ``Dict``/``Tuple`` observation's categorical leaves and (``masks``) its action mask."""
        outside = self.tree.outside_categories(obs) if categories else None
        if outside is not None:
            i = first + outside[0]
            at = when if when is not None else f"at its step {int(env_step[i]) + 1}"
            raise violation(int(self.env_ids[i]), at, OffSpec(outside[1]))
        empty = self.tree.empty_mask(obs) if masks else None
        if empty is not None:
            i = first + empty
            at = when if when is not None else f"after its step {int(env_step[i])}"
            raise violation(int(self.env_ids[i]), at, OffSpec(
                f"its action mask {self.spec.action_mask!r} allows no action"))
