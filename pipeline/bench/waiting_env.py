"""A benchmark env whose step mostly waits: a simulator behind a socket, or a renderer.

Each step sleeps for a time drawn from a log-normal distribution (uneven:
most steps are quick, a few take several times the median) and does a small
amount of CPU work on its observation, so wall time per step is
milliseconds while CPU time is tens of microseconds. A collector that
steps such envs one after another in one worker reaches a small fraction of
what the envs allow; one that lets no env wait for another's step reaches
``num_envs / mean step wall time``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np


class WaitingEnv(gym.Env):
    """Observations of ``obs_dim`` floats, ``actions`` discrete actions, episodes of ``episode_steps``."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, mean_ms: float = 5.0, sigma: float = 0.8, cpu_us: float = 30.0, obs_dim: int = 8,
                 actions: int = 4, episode_steps: int = 200) -> None:
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
        self.action_space = gym.spaces.Discrete(actions)
        # log-normal with the requested mean: mean = exp(mu + sigma^2 / 2)
        self._mu = float(np.log(mean_ms / 1e3) - sigma**2 / 2)
        self._sigma, self._cpu_s, self._episode_steps = float(sigma), cpu_us / 1e6, episode_steps
        self._rng = np.random.default_rng()
        self._obs = np.zeros(obs_dim, np.float32)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._obs = self._rng.standard_normal(self._obs.shape[0]).astype(np.float32)
        self._t = 0
        return self._obs.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        time.sleep(float(np.exp(self._mu + self._sigma * self._rng.standard_normal())))
        end = time.thread_time() + self._cpu_s
        while time.thread_time() < end:  # the simulator's own CPU work on this side
            self._obs = np.tanh(self._obs + 0.01 * (int(action) - 1.5))
        self._t += 1
        return self._obs.copy(), float(self._obs[0]), False, self._t >= self._episode_steps, {}


@dataclass
class WaitingEnvFactory:
    """Picklable factory of :class:`WaitingEnv` (the benchmark's ``waiting`` workload)."""

    mean_ms: float = 5.0
    sigma: float = 0.8
    cpu_us: float = 30.0

    def __call__(self) -> WaitingEnv:
        return WaitingEnv(self.mean_ms, self.sigma, self.cpu_us)
