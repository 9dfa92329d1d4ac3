"""Which envs of a block returned a NaN or infinite reward or observation, and the error naming the first."""

from __future__ import annotations

from typing import Any

import numpy as np

from components.collector.failures import NonFiniteStep


def non_finite_envs(rewards: np.ndarray, next_obs: np.ndarray, tree: Any, float_obs: bool) -> list[int]:
    """Rows (envs) whose reward or observation holds a NaN or an infinity."""
    flat = next_obs.reshape(len(rewards), -1)
    bad = ~np.isfinite(rewards)
    if tree is not None:
        bad |= tree.non_finite_rows(next_obs)
    elif float_obs:
        bad |= ~np.isfinite(flat).all(axis=1)
    return np.flatnonzero(bad).tolist()


def raise_non_finite(rewards: np.ndarray, next_obs: np.ndarray, tree: Any, float_obs: bool, env_ids: np.ndarray,
                     env_step: np.ndarray) -> None:
    """Name the first env that returned a NaN or infinite reward or observation (a :class:`NonFiniteStep`)."""
    flat = next_obs.reshape(len(rewards), -1)
    for i in range(len(rewards)):
        if not np.isfinite(rewards[i]):
            what = f"reward {rewards[i]}"
        elif tree is not None and tree.non_finite_rows(next_obs[i:i + 1])[0]:
            what = "observation with NaN/inf values"
        elif tree is None and float_obs and not np.isfinite(flat[i]).all():
            what = "observation with NaN/inf values"
        else:
            continue
        raise NonFiniteStep(f"env {int(env_ids[i])} returned a non-finite {what} at its step {int(env_step[i]) + 1}")
