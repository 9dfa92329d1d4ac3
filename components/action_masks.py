"""Action masks: the leaf of the observation tree that says which actions an env allows now.

A board game, a card game or a scheduler allows a different subset of its
actions at every step. Envs say so in one of two ways (SB3-contrib's
``MaskablePPO`` and PettingZoo take both): an ``action_mask`` entry of a
Dict observation, or ``info["action_mask"]``. Either way the mask becomes a
leaf of the observation tree (an info mask is moved into the observation by
:class:`ActionMaskWrapper`), so it travels with the observation through
slots, chunks and replay, and the model reads the mask of exactly the
observation it acts on or is trained on: masked sampling and greedy actions
in the server, masked log-probabilities and entropy in PPO, a masked max in
DQN's targets. ``True`` (non-zero) means allowed; a MultiDiscrete mask has
one entry per choice of each component, concatenated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

#: where a detected mask comes from
SOURCES = ("obs", "info")


class MaskError(ValueError):
    """A mask the pipeline cannot use (wrong size, an action space masks do not apply to): one line."""


def _mask_space(n: int) -> Any:
    from gymnasium import spaces

    return spaces.MultiBinary(n)


def _action_choices(space: Any) -> int:
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        return int(space.n)
    if isinstance(space, spaces.MultiDiscrete):
        return int(np.sum(space.nvec))
    raise MaskError(f"action masks apply to Discrete and MultiDiscrete action spaces, not {space}")


class ActionMaskWrapper:
    """Marks the mask leaf of an env (``from_info``: moves ``info[key]`` into a Dict observation first).

    The wrapped observation is the env's own Dict with ``key`` added, or
    ``{"observation": obs, key: mask}`` for a non-Dict one. An info without
    the mask at some step is an error naming the step: a missing mask cannot
    be guessed. Not a ``gymnasium.Wrapper``: that one refuses envs that are
    not ``gymnasium.Env`` subclasses, which the pipeline takes.
    """

    def __init__(self, env: Any, key: str, from_info: bool) -> None:
        from gymnasium import spaces

        self.env = env
        self.action_space = env.action_space
        self.observation_space = env.observation_space
        self.action_mask_leaf = key
        self.action_mask_source = "info" if from_info else "obs"  # what the plan says
        self._from_info = from_info
        self._size = _action_choices(env.action_space)
        self._step = 0
        inner = env.observation_space
        self._dict = isinstance(inner, spaces.Dict)
        if from_info:
            mask = _mask_space(self._size)
            self.observation_space = (spaces.Dict({**inner.spaces, key: mask}) if self._dict
                                      else spaces.Dict({"observation": inner, key: mask}))

    def _merge(self, obs: Any, info: dict[str, Any]) -> Any:
        if not self._from_info:
            return obs
        if self.action_mask_leaf not in info:
            raise MaskError(f"the env's info has no {self.action_mask_leaf!r} at its step {self._step} (it had one "
                            "on reset; the mask must come with every step)")
        mask = np.asarray(info[self.action_mask_leaf]).astype(np.int8, copy=False).reshape(self._size)
        if self._dict:
            return {**obs, self.action_mask_leaf: mask}
        return {"observation": obs, self.action_mask_leaf: mask}

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        self._step = 0
        return self._merge(obs, info), info

    def step(self, action: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._step += 1
        return self._merge(obs, info), reward, terminated, truncated, info

    def close(self) -> None:
        self.env.close()

    def __getattr__(self, name: str) -> Any:  # render, spec, unwrapped, ...: the env's own
        if name.startswith("_") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


@dataclass
class MaskedEnvFactory:
    """``factory``'s envs with their mask leaf marked (picklable when ``factory`` is)."""

    factory: Any
    key: str
    source: str

    def __call__(self) -> Any:
        return ActionMaskWrapper(self.factory(), self.key, self.source == "info")


def detect_mask(env: Any, key: str) -> str | None:
    """Where ``env`` (fresh, not reset yet) gives its action mask: ``"obs"``, ``"info"`` or None.

    An info mask is only seen after a reset, so this resets the env once
    (with seed 0) when its observation has no ``key`` leaf and its actions
    can be masked.
    """
    from gymnasium import spaces

    obs_space, act_space = env.observation_space, env.action_space
    if isinstance(obs_space, spaces.Dict) and key in obs_space.spaces:
        return "obs"
    if not isinstance(act_space, (spaces.Discrete, spaces.MultiDiscrete)):
        return None
    _, info = env.reset(seed=0)
    return "info" if isinstance(info, dict) and key in info else None


def with_masks(factory: Any, key: str | None) -> Any:
    """``factory`` wrapped so its envs mark their ``key`` mask, if they have one (env sets: each entry)."""
    if not key:
        return factory
    entries = getattr(factory, "entries", None)
    if entries is not None:  # an env set: wrap each entry's factory, keep the set
        from components.env_set import EnvSet

        return EnvSet([dataclasses.replace(e, factory=with_masks(e.factory, key)) for e in entries])
    env = factory()
    try:
        source = detect_mask(env, key)
    finally:
        env.close()
    return factory if source is None else MaskedEnvFactory(factory, key, source)


def checked_mask_spec(spec: Any, name: str, source: str = "obs") -> Any:
    """``spec`` with ``action_mask=name`` (from ``source``), the leaf checked against the action space (a
    :class:`MaskError` line)."""
    if spec.action_kind not in ("discrete", "multi_discrete"):
        raise MaskError(f"the env gives an action mask ({name!r}) but its actions are {spec.action_kind}: "
                             "masks apply to Discrete and MultiDiscrete actions")
    leaf = next((leaf for leaf in spec.obs_leaves if leaf.name == name), None)
    if leaf is None:
        raise MaskError(f"the action mask {name!r} is not a top-level leaf of the observation")
    size = int(np.prod(leaf.shape)) if leaf.shape else 1
    if size != spec.mask_size or leaf.dtype not in ("int8", "uint8", "bool", "int64", "int32"):
        raise MaskError(f"the action mask {name!r} is {leaf.shape} {leaf.dtype}; the action space needs "
                             f"{spec.mask_size} 0/1 entries")
    return dataclasses.replace(spec, action_mask=name, action_mask_source=source)


def mask_segments(spec: Any) -> list[tuple[int, int]]:
    """``(start, stop)`` of each component's choices in the flat mask (one segment for Discrete)."""
    if spec.action_kind == "multi_discrete":
        ends = np.cumsum(spec.action_nvec)
        return [(int(e - n), int(e)) for e, n in zip(ends, spec.action_nvec)]
    return [(0, spec.mask_size)]


def first_empty(masks: np.ndarray, segments: list[tuple[int, int]]) -> int | None:
    """The first row of ``masks`` (``[rows, size]``) allowing no action (in some component), or None."""
    for start, stop in segments:
        empty = ~masks[:, start:stop].any(axis=1)
        if empty.any():
            return int(np.flatnonzero(empty)[0])
    return None


def allowed_action(space: Any, mask: Any, rng: np.random.Generator) -> Any:
    """A uniformly random action of ``space`` that ``mask`` allows (probes stepping a masked env)."""
    flat = np.asarray(mask).reshape(-1) != 0
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        return np.int64(space.start + rng.choice(np.flatnonzero(flat)))
    picks = []
    for n, start in zip(np.ravel(space.nvec), np.cumsum(np.ravel(space.nvec)) - np.ravel(space.nvec)):
        picks.append(rng.choice(np.flatnonzero(flat[start:start + n])))
    return np.asarray(picks, space.dtype).reshape(space.shape)
