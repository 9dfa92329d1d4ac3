"""A benchmark env with big observations and almost no step cost: what moving bytes costs.

Each observation is a raw ``210x160x3`` uint8 frame (an Atari screen before
preprocessing: 100,800 bytes), and a step does nothing but pick which of a
few pre-drawn frames comes next, so a step costs about a microsecond. On
this workload a collector's speed is its copies: from the env into shared
memory, into the policy's input, into the chunk and the batch. A plain
loop copies each observation once or twice; a collector that copies it
five times, or converts every row to float before the model needs it, falls
below that loop however well its layout hides the envs' time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

#: distinct frames an env cycles through (drawn once: the step only indexes them)
FRAMES = 4


class FramesEnv(gym.Env):
    """``shape`` uint8 observations, ``actions`` discrete actions, episodes of ``episode_steps``."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, shape: tuple[int, ...] = (210, 160, 3), actions: int = 6, episode_steps: int = 1000) -> None:
        self.observation_space = gym.spaces.Box(0, 255, tuple(shape), np.uint8)
        self.action_space = gym.spaces.Discrete(actions)
        self._frames = np.zeros((FRAMES, *shape), np.uint8)
        self._episode_steps = episode_steps
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._frames = self.np_random.integers(0, 256, self._frames.shape, dtype=np.uint8)
        self._t = 0
        return self._frames[0], {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._t += 1
        # A view of a frame the env keeps: like an emulator's screen buffer, the caller must copy it.
        obs = self._frames[(self._t + int(action)) % FRAMES]
        return obs, float(action == 0), False, self._t >= self._episode_steps, {}


@dataclass
class FramesEnvFactory:
    """Picklable factory of :class:`FramesEnv` (the benchmark's ``frames`` workload)."""

    height: int = 210
    width: int = 160
    channels: int = 3
    episode_steps: int = 1000

    def __call__(self) -> FramesEnv:
        return FramesEnv((self.height, self.width, self.channels), episode_steps=self.episode_steps)
