"""A custom env and a custom model, trained by ``python -m pipeline`` (see docs/bring-your-own.md).

``PickEnv`` is a tiny scheduling task: a Dict observation (a ``board`` of
slot loads and the ``job`` to place) with an ``action_mask`` of the slots
that are free. Placing the job in the least loaded free slot scores 1; a
masked (full) slot raises, as a real scheduler would refuse it.
``SlotPolicy`` is a model of your own: it reads the leaves it wants by name
and honours the mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from components.obs_input import masked

SLOTS = 6


class PickEnv(gym.Env):
    """Put each job in the least loaded free slot; 8 jobs per episode, best return 8."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Dict({
            "board": gym.spaces.Box(0.0, 1.0, (SLOTS,), np.float32),
            "job": gym.spaces.Discrete(3),
            "action_mask": gym.spaces.MultiBinary(SLOTS),
        })
        self.action_space = gym.spaces.Discrete(SLOTS)
        self._rng = np.random.default_rng(0)
        self._t = 0

    def _draw(self) -> None:
        self._load = self._rng.random(SLOTS).astype(np.float32)
        self._free = (self._rng.random(SLOTS) < 0.5).astype(np.int8)
        self._free[self._rng.integers(SLOTS)] = 1  # at least one free slot
        self._job = int(self._rng.integers(3))

    def _obs(self) -> dict[str, Any]:
        return {"board": self._load.copy(), "job": self._job, "action_mask": self._free.copy()}

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[dict[str, Any], dict]:
        super().reset(seed=seed)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._t = 0
        self._draw()
        return self._obs(), {}

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict]:
        slot = int(action)
        if not self._free[slot]:
            raise ValueError(f"slot {slot} is full (free: {np.flatnonzero(self._free).tolist()})")
        best = int(np.argmin(np.where(self._free == 1, self._load, np.inf)))
        reward = float(slot == best)
        self._t += 1
        self._draw()
        return self._obs(), reward, False, self._t >= 8, {}


@dataclass
class PickEnvFactory:
    """What ``env.factory._target_`` names: picklable, so process workers can build the env themselves."""

    def __call__(self) -> PickEnv:
        return PickEnv()


class SlotPolicy(nn.Module):
    """Scores every slot from its load; the contract is in components/model_contract.py.

    Built as ``SlotPolicy(env_spec, width=...)``. ``obs`` is the Dict
    observation as a nested TensorDict of the env's leaves (``obs["board"]``,
    ``obs["job"]``, ``obs["action_mask"]``), in the server and in the trainer alike.
    """

    def __init__(self, spec: Any, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(SLOTS + 3, width), nn.Tanh())
        self.logits, self.critic = nn.Linear(width, SLOTS), nn.Linear(width, 1)

    def _heads(self, obs: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
        job = nn.functional.one_hot(obs["job"].long(), 3).float()
        x = self.body(torch.cat([obs["board"], job], -1))
        return masked(self.logits(x), obs["action_mask"] != 0), self.critic(x).squeeze(-1)

    def act(self, inputs: dict[str, Any], modes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits, value = self._heads(inputs["observation"])
        dist = torch.distributions.Categorical(logits=logits)
        action = dist.sample()
        if modes is not None:  # greedy rows (evaluation)
            action = torch.where(modes != 0, logits.argmax(-1), action)
        return {"action": action, "sample_log_prob": dist.log_prob(action), "state_value": value}

    def evaluate(self, obs: TensorDict, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, value = self._heads(obs)
        dist = torch.distributions.Categorical(logits=logits)
        return dist.log_prob(action.long()), dist.entropy(), value

    def value(self, obs: TensorDict) -> torch.Tensor:
        return self._heads(obs)[1]
