"""A block of environments stepped together by one worker.

A worker hosts ``envs_per_worker`` envs and sends their observations as one
request, so signalling costs are paid per block, not per env. The block
writes every output straight into caller-provided arrays (rows of a shared
chunk buffer), so no per-transition Python objects survive a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from components.envs import EnvSpec

#: Keys of the env half of a transition (the policy adds its outputs).
NEXT_KEYS = (
    "next.observation",
    "next.reward",
    "next.terminated",
    "next.truncated",
    "next.done",
    "next.episode_return",
    "next.episode_length",
)


class EnvBlock:
    """Steps ``len(env_ids)`` envs with automatic reset and episode tracking.

    Examples:
        >>> from components.envs import GymEnvFactory
        >>> block = EnvBlock(GymEnvFactory("CartPole-v1"), env_ids=[0, 1], seeds=[1, 2])
        >>> obs = np.zeros((2, 4), np.float32)
        >>> block.reset(obs)
        >>> rows = block.empty_rows()
        >>> block.step(np.array([0, 1]), rows, obs)  # envs whose step was cut out as non-finite
        0
        >>> rows["next.episode_length"].tolist()
        [1, 1]
        >>> block.close()
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        env_ids: Sequence[int],
        seeds: Sequence[int],
        first_step: int = 0,
        skip_non_finite: bool = False,
    ) -> None:
        if len(env_ids) != len(seeds):
            raise ValueError("one seed per env is required")
        self.env_ids = np.asarray(env_ids, dtype=np.int64)
        self._seeds = [int(s) for s in seeds]
        self._envs: list[Any] = []
        try:
            for _ in env_ids:
                self._envs.append(factory())
        except BaseException:
            self.close()
            raise
        self.spec = EnvSpec.from_env(self._envs[0])
        self._discrete = self.spec.action_kind == "discrete"
        # Integer observations (Atari frames) cannot be NaN: only float ones are checked.
        self._float_obs = np.issubdtype(np.dtype(self.spec.obs_dtype), np.floating)
        if not self._discrete:
            self._low = np.asarray(self.spec.action_low, np.float32).reshape(self.spec.action_shape)
            self._high = np.asarray(self.spec.action_high, np.float32).reshape(self.spec.action_shape)
        n = len(self._envs)
        self._episode_return = np.zeros(n, np.float64)
        self._episode_length = np.zeros(n, np.int64)
        #: Steps taken by each env since the block started (contiguous per env). A block that
        #: replaces a crashed one starts past its predecessor's steps, leaving a gap that tells
        #: learners the trajectory was cut there.
        self.env_step = np.full(n, first_step, np.int64)
        #: ``trainer.nan_policy=skip``: a non-finite step is cut out (see :meth:`step`), not an error
        self.skip_non_finite = skip_non_finite

    def __len__(self) -> int:
        return len(self._envs)

    def empty_rows(self) -> dict[str, np.ndarray]:
        """Private arrays for one step's env outputs (tests, thread helpers)."""
        n, spec = len(self), self.spec
        return {
            "next.observation": np.zeros((n, *spec.obs_shape), spec.obs_dtype),
            "next.reward": np.zeros(n, np.float32),
            "next.terminated": np.zeros(n, bool),
            "next.truncated": np.zeros(n, bool),
            "next.done": np.zeros(n, bool),
            "next.episode_return": np.zeros(n, np.float32),
            "next.episode_length": np.zeros(n, np.int64),
        }

    def reset(self, obs_out: np.ndarray) -> None:
        """Reset every env with its own seed and write the first observations."""
        for i, env in enumerate(self._envs):
            obs, _ = env.reset(seed=self._seeds[i])
            env.action_space.seed(self._seeds[i])
            obs_out[i] = obs
        self._episode_return[:] = 0.0
        self._episode_length[:] = 0

    def step(
        self,
        actions: np.ndarray,
        rows: Mapping[str, np.ndarray],
        obs_out: np.ndarray,
        truncate: bool = False,
    ) -> int:
        """Step every env once; returns how many envs' steps were cut out as non-finite.

        Writes the env half of the transition into ``rows`` (arrays indexed by
        env) and the observations the policy must act on next into
        ``obs_out``: the successor, or the first observation of a new episode
        where one ended (``rows["next.observation"]`` keeps the final one).
        ``truncate`` ends every episode after this step, as a time limit
        would (``reset_at_each_iter``): the transition is marked truncated,
        so learners bootstrap it instead of chaining it to the next one.

        A NaN or infinite reward or observation is an error naming the env;
        with ``skip_non_finite`` the step is cut out instead: recorded as a
        zero-reward truncation back to the observation acted on (so nothing
        non-finite reaches a learner, and a bootstrap from it is neutral),
        and the env is reset.
        """
        skipped = 0
        next_obs = rows["next.observation"]
        acts = actions.tolist() if self._discrete else np.clip(actions, self._low, self._high)
        rewards = [0.0] * len(self._envs)
        terminated = [False] * len(self._envs)
        truncated = [False] * len(self._envs)
        ended: list[int] = []
        for i, env in enumerate(self._envs):
            obs, reward, term, trunc, _ = env.step(acts[i])
            next_obs[i] = obs
            rewards[i] = reward
            trunc = trunc or (truncate and not term)
            if term or trunc:
                terminated[i] = term
                truncated[i] = trunc
                ended.append(i)
        reward_arr = rows["next.reward"]
        reward_arr[:] = rewards
        if not np.isfinite(reward_arr).all() or (self._float_obs and not np.isfinite(next_obs).all()):
            if not self.skip_non_finite:
                self._non_finite(reward_arr, next_obs)
            for i in self._non_finite_envs(reward_arr, next_obs):
                next_obs[i] = obs_out[i]  # still the observation acted on
                reward_arr[i] = 0.0
                terminated[i], truncated[i] = False, True
                if i not in ended:
                    ended.append(i)
                skipped += 1
        rows["next.terminated"][:] = terminated
        rows["next.truncated"][:] = truncated
        done = rows["next.done"]
        np.logical_or(rows["next.terminated"], rows["next.truncated"], out=done)
        self._episode_return += reward_arr
        self._episode_length += 1
        self.env_step += 1
        rows["next.episode_return"][:] = self._episode_return
        rows["next.episode_length"][:] = self._episode_length
        obs_out[:] = next_obs
        for i in ended:
            obs, _ = self._envs[i].reset()
            obs_out[i] = obs
            self._episode_return[i] = 0.0
            self._episode_length[i] = 0
        return skipped

    def _non_finite_envs(self, rewards: np.ndarray, next_obs: np.ndarray) -> list[int]:
        flat = next_obs.reshape(len(self._envs), -1)
        bad = ~np.isfinite(rewards)
        if self._float_obs:
            bad |= ~np.isfinite(flat).all(axis=1)
        return np.flatnonzero(bad).tolist()

    def _non_finite(self, rewards: np.ndarray, next_obs: np.ndarray) -> None:
        """Name the first env that returned a NaN or infinite reward or observation."""
        flat = next_obs.reshape(len(self._envs), -1)
        for i in range(len(self._envs)):
            if not np.isfinite(rewards[i]):
                what = f"reward {rewards[i]}"
            elif self._float_obs and not np.isfinite(flat[i]).all():
                what = "observation with NaN/inf values"
            else:
                continue
            raise ValueError(f"env {int(self.env_ids[i])} returned a non-finite {what} at its step "
                             f"{int(self.env_step[i]) + 1}")

    def close(self) -> None:
        for env in self._envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing must not mask the real error
                pass
        self._envs = []
