"""Partially observed classic-control envs: the velocities hidden, so only a policy with memory can act well.

Why: CartPole and Pendulum are solved from one observation because it
holds both positions and velocities; drop the velocities and a
feed-forward policy sees a still picture, while a recurrent one can infer
motion from consecutive frames (the "no velocity" benchmarks of the
recurrent-PPO literature: SB3-contrib's ``CartPoleNoVel``, CleanRL's LSTM
variants). :class:`NoVelocityEnvFactory` builds such an env from a
gymnasium id, picked from config with ``env=no_velocity [env.id=...]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

#: per env name (the id without its version), the observation entries that are not velocities
POSITIONS: dict[str, tuple[int, ...]] = {
    "CartPole": (0, 2),  # cart position, pole angle (of x, x_dot, theta, theta_dot)
    "Pendulum": (0, 1),  # cos and sin of the angle (of cos, sin, angular velocity)
    "Acrobot": (0, 1, 2, 3),  # cos and sin of both joint angles (of those plus two angular velocities)
    "MountainCar": (0,),  # position (of position, velocity)
    "MountainCarContinuous": (0,),
}


def positions_of(env_id: str) -> tuple[int, ...]:
    """The observation entries of ``env_id`` that :data:`POSITIONS` keeps; ValueError for an env it does not know."""
    name = env_id.split("/")[-1].rsplit("-v", 1)[0]
    if name not in POSITIONS:
        raise ValueError(f"no known velocities to hide in {env_id!r} (known: {', '.join(sorted(POSITIONS))}); "
                         "name the entries to keep with env.factory.keep=[...]")
    return POSITIONS[name]


class KeepObservationEntries(gym.ObservationWrapper):
    """A 1-D Box observation cut down to the entries ``keep`` (the rest, e.g. velocities, never reach the policy)."""

    def __init__(self, env: gym.Env, keep: Sequence[int]) -> None:
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
            raise ValueError(f"keeps entries of a 1-D Box observation, not of {space}")
        keep = [int(i) for i in keep]
        if not keep or len(set(keep)) != len(keep) or not all(0 <= i < space.shape[0] for i in keep):
            raise ValueError(f"keep={keep}: distinct entries of an observation of {space.shape[0]} are needed")
        self._keep = np.asarray(keep, np.int64)
        self.observation_space = gym.spaces.Box(space.low[self._keep], space.high[self._keep], dtype=space.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self._keep]


@dataclass
class NoVelocityEnvFactory:
    """Builds ``gym.make(id, **kwargs)`` with only its position entries observed (``keep``: your own choice).

    Examples:
        >>> env = NoVelocityEnvFactory("CartPole-v1")()
        >>> env.observation_space.shape, env.reset(seed=0)[0].shape
        ((2,), (2,))
    """

    id: str = "CartPole-v1"
    keep: list[int] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keep = list(self.keep) if self.keep is not None else list(positions_of(self.id))

    def __call__(self) -> gym.Env:
        from components.envs import GymEnvFactory

        return KeepObservationEntries(GymEnvFactory(self.id, dict(self.kwargs))(), self.keep)
