"""Small stand-in models with observable behaviour for server and transport tests."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


class RecordingModel(torch.nn.Module):
    """action = round(sum of the observation row) * scale + mode; records batch sizes.

    ``scale`` is a buffer, so weight updates change the actions; observations
    with a NaN make the forward raise (a model error one request can cause);
    an observation of -999 kills whatever runs the server (a fatal fault:
    ``SystemExit`` is not an ``Exception`` the serve loop isolates).
    """

    in_keys = ("observation",)

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))
        self.delay = delay
        self.gate = gate
        self.batch_sizes: list[int] = []

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor) -> dict[str, torch.Tensor]:
        obs = torch.as_tensor(inputs["observation"])
        modes = torch.as_tensor(modes)
        if self.gate is not None:
            self.gate.wait(10)
        if torch.isnan(obs).any():
            raise ValueError("NaN in the observation")
        if (obs == -999).any():
            raise SystemExit("fatal fault in the served model")
        self.batch_sizes.append(obs.shape[0])
        if self.delay:
            time.sleep(self.delay)
        rows = obs.reshape(obs.shape[0], -1).sum(-1)
        return {"action": (rows.round() * self.scale).long() * 10 + modes.long()}


def make_recording_model(spec, delay: float = 0.0) -> RecordingModel:  # noqa: ANN001
    """ModelSpec-compatible builder, so a server process can rebuild the fake."""
    return RecordingModel(delay=delay)


def _first_to_claim(path: str) -> bool:
    import os

    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class FaultyEnvFactory:
    """CartPole whose envs fail from their ``at_step``-th step (each env counts its own).

    ``fault``: "raise" (an env that crashes), "hang" (a step that blocks for
    an hour: a hung simulator), "nan_reward" (a NaN reward) or "nan_obs"
    (an all-NaN observation). Usable from the
    command line: ``env.factory._target_=tests.fakes.FaultyEnvFactory
    +env.factory.at_step=30 +env.factory.fault=nan_reward``.
    """

    def __init__(self, at_step: int, fault: str = "raise", id: str = "CartPole-v1",  # noqa: A002
                 once: str | None = None) -> None:
        if fault not in ("raise", "hang", "nan_reward", "nan_obs"):
            raise ValueError(f"unknown fault {fault!r}")
        self.at_step, self.fault, self.id, self.once = at_step, fault, id, once

    def __call__(self):  # noqa: ANN204
        import gymnasium as gym

        at_step, fault, once = self.at_step, self.fault, self.once

        class Faulty(gym.Wrapper):
            steps = 0

            def step(self, action):  # noqa: ANN001, ANN202
                Faulty.steps += 1
                # ``once``: a marker file; only the first env to create it fails (a restart then succeeds)
                if Faulty.steps >= at_step and (once is None or _first_to_claim(once)):
                    if fault == "hang":
                        time.sleep(3600)
                    if fault == "nan_reward":
                        obs, reward, term, trunc, info = self.env.step(action)
                        return obs, float("nan"), term, trunc, info
                    if fault == "nan_obs":
                        obs, reward, term, trunc, info = self.env.step(action)
                        return obs * float("nan"), reward, term, trunc, info
                    raise RuntimeError(f"boom at step {at_step}")
                return self.env.step(action)

        return Faulty(gym.make(self.id))


class ExplodingEnvFactory(FaultyEnvFactory):
    def __init__(self, at_step: int) -> None:
        super().__init__(at_step, "raise")


class HangingEnvFactory(FaultyEnvFactory):
    def __init__(self, at_step: int) -> None:
        super().__init__(at_step, "hang")


#: SpecBreakingEnvFactory's faults: what CartPole's step (or, for ``reset_*``, reset) returns instead.
SPEC_FAULTS = {
    "obs_shape": lambda obs, reward, term: (np.append(obs, np.float32(0)), reward, term),  # (5,) not (4,)
    "obs_scalar": lambda obs, reward, term: (np.float32(obs[0]), reward, term),
    "obs_object": lambda obs, reward, term: (obs.astype(object), reward, term),
    "obs_list": lambda obs, reward, term: (obs.tolist(), reward, term),
    "obs_dict": lambda obs, reward, term: ({"state": obs}, reward, term),
    "obs_float64": lambda obs, reward, term: (obs.astype(np.float64), reward, term),
    "reward_1": lambda obs, reward, term: (obs, np.array([reward]), term),
    "reward_2": lambda obs, reward, term: (obs, np.array([reward, reward]), term),
    "reward_str": lambda obs, reward, term: (obs, str(reward), term),
    "reward_np": lambda obs, reward, term: (obs, np.float32(reward), term),
    "terminated_np": lambda obs, reward, term: (obs, reward, np.bool_(term)),
    "terminated_pair": lambda obs, reward, term: (obs, reward, np.array([term, term])),
    "reset_obs_shape": lambda obs, reward, term: (np.append(obs, np.float32(0)), reward, term),
}


class SpecBreakingEnvFactory:
    """CartPole whose envs return values off their spec from their ``at_step``-th step (each env counts its own).

    ``fault`` names one of :data:`SPEC_FAULTS` (an observation of another
    shape or dtype, a reward that is an array or a string, ...). ``reset_*``
    faults apply to the ``at_step``-th reset onwards (the first reset is 1).
    ``once``: a marker file; only the first env to create it misbehaves, once.
    From the command line: ``env.factory._target_=tests.fakes.SpecBreakingEnvFactory
    +env.factory.at_step=30 +env.factory.fault=obs_shape``.
    """

    def __init__(self, at_step: int, fault: str, id: str = "CartPole-v1", once: str | None = None) -> None:  # noqa: A002
        if fault not in SPEC_FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        self.at_step, self.fault, self.id, self.once = at_step, fault, id, once

    def __call__(self):  # noqa: ANN204
        import gymnasium as gym

        at_step, fault, once, change = self.at_step, self.fault, self.once, SPEC_FAULTS[self.fault]
        on_reset = fault.startswith("reset_")

        class SpecBreaking(gym.Wrapper):
            steps = resets = 0

            def _due(self, count: int) -> bool:
                return count >= at_step and (once is None or _first_to_claim(once))

            def reset(self, **kwargs):  # noqa: ANN003, ANN202
                obs, info = self.env.reset(**kwargs)
                SpecBreaking.resets += 1
                if on_reset and self._due(SpecBreaking.resets):
                    obs = change(obs, 0.0, False)[0]
                return obs, info

            def step(self, action):  # noqa: ANN001, ANN202
                obs, reward, term, trunc, info = self.env.step(action)
                SpecBreaking.steps += 1
                if not on_reset and self._due(SpecBreaking.steps):
                    obs, reward, term = change(obs, reward, term)
                return obs, reward, term, trunc, info

        # no PassiveEnvChecker: it would only warn about the first step anyway
        return SpecBreaking(gym.make(self.id, disable_env_checker=True))


class SlowEnvFactory:
    """CartPole whose steps each sleep ``delay`` seconds: a slow but live simulator.

    ``once``: a marker file; only the first env to create it is slow (one
    slow worker among fast ones), else every env is. From the command line:
    ``env.factory._target_=tests.fakes.SlowEnvFactory +env.factory.delay=0.3``.
    """

    def __init__(self, delay: float, id: str = "CartPole-v1", once: str | None = None) -> None:  # noqa: A002
        self.delay, self.id, self.once = float(delay), id, once

    def __call__(self):  # noqa: ANN204
        import gymnasium as gym

        delay = self.delay if self.once is None or _first_to_claim(self.once) else 0.0

        class Slow(gym.Wrapper):
            def step(self, action):  # noqa: ANN001, ANN202
                if delay:
                    time.sleep(delay)
                return self.env.step(action)

        return Slow(gym.make(self.id))


class StallingPolicy(torch.nn.Module):
    """Acts (action 0) for ``answer`` calls, then never answers again: a server that stopped answering."""

    in_keys = ("observation",)

    def __init__(self, answer: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))
        self.answer = answer
        self.calls = 0

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls > self.answer:
            time.sleep(3600)
        obs = torch.as_tensor(inputs["observation"])
        return {"action": torch.zeros(obs.shape[0], dtype=torch.int64)}


def make_stalling_policy(spec, answer: int = 20) -> StallingPolicy:  # noqa: ANN001
    return StallingPolicy(answer)



class CountingEnvFactory:
    """Envs whose observation says where they are: ``[episode, step in episode, env seed, poisoned]``.

    Episode ``k`` lasts ``2 + k % 5`` steps (ends at every chunk offset),
    terminating on even episodes and truncating on odd ones, so each
    transition's observation and successor can be checked exactly. With
    ``nan_every``, every ``nan_every``-th step of an env returns a NaN
    observation (``trainer.nan_policy=skip`` must cut it out). ``shape``
    pads the observation to that many values (the four first still say
    where the env is), for frames big enough to take the copy paths.
    """

    def __init__(self, nan_every: int = 0, size: int = 4) -> None:
        self.nan_every, self.size = int(nan_every), max(4, int(size))

    def __call__(self):  # noqa: ANN204
        import gymnasium as gym

        nan_every, size = self.nan_every, self.size

        class Counting(gym.Env):
            observation_space = gym.spaces.Box(-np.inf, np.inf, (size,), np.float32)
            action_space = gym.spaces.Discrete(2)

            def __init__(self) -> None:
                self.episode, self.t, self.seed_, self.steps = -1, 0, -1.0, 0

            def _obs(self, poisoned: bool = False) -> np.ndarray:
                out = np.zeros(size, np.float32)
                out[:4] = (self.episode, self.t, self.seed_, float(poisoned))
                if poisoned:
                    out[3] = np.nan
                return out

            def reset(self, *, seed=None, options=None):  # noqa: ANN001, ANN202
                if seed is not None:
                    self.seed_ = float(seed)
                self.episode += 1
                self.t = 0
                return self._obs(), {}

            def step(self, action):  # noqa: ANN001, ANN202
                self.t += 1
                self.steps += 1
                length = 2 + self.episode % 5
                ended = self.t >= length
                poisoned = bool(nan_every) and self.steps % nan_every == 0
                return (self._obs(poisoned), 1.0, ended and self.episode % 2 == 0,
                        ended and self.episode % 2 == 1, {})

        return Counting()


def closure_env_factory(env_id: str = "CartPole-v1"):  # noqa: ANN201 - what a user's env.factory._target_ may return
    """A factory that closes over its argument: plain pickle cannot carry it to a process worker."""
    import gymnasium as gym

    return lambda: gym.make(env_id)


class MatchEnv:
    """Observations and actions of any flat space; the reward counts the action components that match the target.

    ``obs``: multi_discrete (the target itself, 3 components of 3), multi_binary or discrete (target as one
    category). ``act``: multi_discrete ([3, 3, 3]) or multi_binary (3 flags: the target's components modulo 2).
    Every action is checked against the action space (an action off the space raises), episodes last 8 steps.
    A random policy scores about 8 x 1 (multi_discrete) or 8 x 1.5 (multi_binary); the best one 24.
    """

    def __init__(self, obs: str = "multi_discrete", act: str = "multi_discrete", seed: int = 0) -> None:
        import gymnasium as gym

        self.obs_kind, self.act_kind = obs, act
        self.observation_space = {"multi_discrete": gym.spaces.MultiDiscrete([3, 3, 3]),
                                  "multi_binary": gym.spaces.MultiBinary(3),
                                  "discrete": gym.spaces.Discrete(27, start=5)}[obs]
        self.action_space = gym.spaces.MultiDiscrete([3, 3, 3]) if act == "multi_discrete" else gym.spaces.MultiBinary(3)
        self._rng = np.random.default_rng(seed)
        self._target = np.zeros(3, np.int64)
        self._t = 0

    def _obs(self) -> Any:
        if self.obs_kind == "multi_discrete":
            return self._target.copy()
        if self.obs_kind == "multi_binary":
            return (self._target % 2).astype(np.int8)
        return int(5 + self._target[0] * 9 + self._target[1] * 3 + self._target[2])

    def reset(self, seed: int | None = None, options: Any = None) -> tuple[Any, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._target = self._rng.integers(0, 3, 3)
        self._t = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is off the action space {self.action_space}")
        goal = self._target if self.act_kind == "multi_discrete" else self._target % 2
        reward = float(np.sum(np.asarray(action) == goal))
        self._t += 1
        self._target = self._rng.integers(0, 3, 3)
        return self._obs(), reward, False, self._t >= 8, {}

    def close(self) -> None:
        pass


@dataclass
class MatchEnvFactory:
    """A picklable factory of :class:`MatchEnv` (process workers import it by name)."""

    obs: str = "multi_discrete"
    act: str = "multi_discrete"

    def __call__(self) -> MatchEnv:
        return MatchEnv(self.obs, self.act)


class TinyActorCritic(torch.nn.Module):
    """A user's own model, written against the documented contract only (components/model_contract.py).

    One shared layer of ``width`` units for Discrete actions; takes no other model.* key, so the ones every
    model config has (encoder, hidden, ...) are not passed to it.
    """

    def __init__(self, spec, width: int = 16) -> None:  # noqa: ANN001
        super().__init__()
        obs = int(np.prod(spec.obs_shape)) if spec.obs_shape else 1
        self.body = torch.nn.Sequential(torch.nn.Linear(obs, width), torch.nn.Tanh())
        self.logits, self.critic = torch.nn.Linear(width, spec.action_n), torch.nn.Linear(width, 1)

    def _heads(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.body(obs.reshape(obs.shape[0], -1).float())
        return self.logits(x), self.critic(x).squeeze(-1)

    def act(self, inputs, modes=None):  # noqa: ANN001, ANN201
        logits, value = self._heads(inputs["observation"])
        dist = torch.distributions.Categorical(logits=logits)
        action = dist.sample()
        if modes is not None:
            action = torch.where(modes != 0, logits.argmax(-1), action)
        return {"action": action, "sample_log_prob": dist.log_prob(action), "state_value": value}

    def evaluate(self, obs, action):  # noqa: ANN001, ANN201
        logits, value = self._heads(obs)
        dist = torch.distributions.Categorical(logits=logits)
        return dist.log_prob(action.long()), dist.entropy(), value

    def value(self, obs):  # noqa: ANN001, ANN201
        return self._heads(obs)[1]


class NoEvaluateModel(TinyActorCritic):
    """Breaks the contract: PPO calls evaluate."""

    evaluate = None  # type: ignore[assignment]


class WrongShapeModel(TinyActorCritic):
    """Breaks the contract: one action column per row instead of one action per row."""

    def act(self, inputs, modes=None):  # noqa: ANN001, ANN201
        out = super().act(inputs, modes)
        return {**out, "action": out["action"].unsqueeze(-1)}


class TreeEnv:
    """A Dict (or Tuple) observation of every leaf kind, optionally with an action mask; act to match the goal.

    ``kind``: ``dict`` ({goal: Discrete(n), frame: uint8 [2, 3, 3], state: float64 [2], flags: MultiBinary(3)})
    or ``tuple`` ((goal, state float32 [2], {cells: MultiDiscrete([2, 3])})). Every leaf is a function of the
    step ``t`` and the goal, so a reader can check each transition bit for bit (:func:`tree_consistent`).
    ``mask``: ``obs`` (an ``action_mask`` leaf) or ``info`` (``info["action_mask"]``) allows the goal and one
    decoy; a masked action raises. The reward is 1 for the goal; episodes last 8 steps (best return 8).
    """

    def __init__(self, kind: str = "dict", mask: str | None = None, n: int = 5, empty_mask_at: int = -1) -> None:
        import gymnasium as gym

        s = gym.spaces
        self.kind, self.mask, self.n, self.empty_mask_at = kind, mask, n, empty_mask_at
        if kind == "dict":
            leaves = {"goal": s.Discrete(n), "frame": s.Box(0, 255, (2, 3, 3), np.uint8),
                      "state": s.Box(-np.inf, np.inf, (2,), np.float64), "flags": s.MultiBinary(3)}
            if mask == "obs":
                leaves["action_mask"] = s.MultiBinary(n)
            self.observation_space = s.Dict(leaves)
        else:
            self.observation_space = s.Tuple((s.Discrete(n), s.Box(-np.inf, np.inf, (2,), np.float32),
                                              s.Dict({"cells": s.MultiDiscrete([2, 3])})))
        self.action_space = s.Discrete(n)
        self._rng = np.random.default_rng(0)
        self._t, self._goal, self._allowed = 0, 0, np.ones(n, np.int8)

    def _draw(self) -> None:
        self._goal = int(self._rng.integers(self.n))
        self._allowed = np.zeros(self.n, np.int8)
        if self._t != self.empty_mask_at:
            self._allowed[self._goal] = 1
            self._allowed[(self._goal + 1 + int(self._rng.integers(self.n - 1))) % self.n] = 1

    def _obs(self) -> Any:
        t, g = self._t, self._goal
        if self.kind == "tuple":
            return (g, np.array([t, t / 3.0], np.float32), {"cells": np.array([t % 2, g % 3], np.int64)})
        obs = {"goal": g, "frame": np.full((2, 3, 3), (t * 7 + g) % 256, np.uint8),
               "state": np.array([t, t / 3.0]), "flags": np.array([g & 1, (g >> 1) & 1, (g >> 2) & 1], np.int8)}
        if self.mask == "obs":
            obs["action_mask"] = self._allowed.copy()
        return obs

    def _info(self) -> dict:
        return {"action_mask": self._allowed.astype(bool)} if self.mask == "info" else {}

    def reset(self, seed: int | None = None, options: Any = None) -> tuple[Any, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._t = 0
        self._draw()
        return self._obs(), self._info()

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        action = int(action)
        if self.mask and not self._allowed[action]:
            raise ValueError(f"masked action {action} taken at step {self._t} (allowed {self._allowed.tolist()})")
        reward = float(action == self._goal)
        self._t += 1
        self._draw()
        return self._obs(), reward, False, self._t >= 8, self._info()

    def close(self) -> None:
        pass


@dataclass
class TreeEnvFactory:
    """A picklable factory of :class:`TreeEnv`."""

    kind: str = "dict"
    mask: str | None = None
    n: int = 5
    empty_mask_at: int = -1

    def __call__(self) -> TreeEnv:
        return TreeEnv(self.kind, self.mask, self.n, self.empty_mask_at)


class TreeReader(TinyActorCritic):
    """A user's model of :class:`TreeEnv`'s Dict: it reads leaves by key (``obs["goal"]``), so it works only if
    every caller (server, inline worker, trainer, evaluation) hands it the nested observation."""

    def __init__(self, spec, width: int = 16) -> None:  # noqa: ANN001
        torch.nn.Module.__init__(self)
        self.n = spec.action_n
        self.body = torch.nn.Sequential(torch.nn.Linear(self.n + 5, width), torch.nn.Tanh())
        self.logits, self.critic = torch.nn.Linear(width, spec.action_n), torch.nn.Linear(width, 1)

    def _heads(self, obs) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        goal = torch.nn.functional.one_hot(obs["goal"].long(), self.n).float()
        x = self.body(torch.cat([goal, obs["state"].float(), obs["flags"].float()], -1))
        logits = self.logits(x)
        if "action_mask" in obs.keys():
            logits = logits.masked_fill(obs["action_mask"] == 0, -1e8)
        return logits, self.critic(x).squeeze(-1)


def nest_packed(batch, leaves):  # noqa: ANN001, ANN201
    """A hand-built batch of packed rows with its observations nested, as the collector delivers them."""
    from components.obs_tree import observation_tree

    for key in ("observation", ("next", "observation")):
        batch.set(key, observation_tree(leaves, batch.get(key)))
    return batch


def tree_consistent(leaves: dict[str, np.ndarray]) -> np.ndarray:
    """Per row, whether the unpacked leaves of :class:`TreeEnv` (dict kind) are one observation, bit for bit."""
    t, g = leaves["state"][..., 0], leaves["goal"]
    ok = (leaves["state"][..., 1] == t / 3.0) & (leaves["frame"].reshape(*g.shape, -1) == ((t * 7 + g) % 256)[..., None]).all(-1)
    bits = np.stack([g & 1, (g >> 1) & 1, (g >> 2) & 1], -1)
    return ok & (leaves["flags"] == bits).all(-1)


class PixelsDictEnv:
    """A Dict observation with a frame-stack image leaf: ``{"pixels": uint8 [stack, 36, 36], "clock": float32 [2]}``.

    Every frame is new (its env ``ident`` and step ``t`` are written in its
    first bytes, a pattern of both after), the stack holds the last
    ``stack`` frames (the reset frame repeated at an episode's start), and
    ``clock`` is ``[t, episode]``: :func:`pixels_consistent` checks any row
    bit for bit. Episodes last 5-9 steps, ending by termination or truncation
    in turn; the reward is 1 for action ``t % 2``. ``extra_image`` adds a
    second image leaf of another shape (stored whole by frame dedup).
    """

    def __init__(self, ident: int = 0, stack: int = 4, extra_image: bool = False) -> None:
        import gymnasium as gym

        s = gym.spaces
        self.ident, self.stack, self.extra_image = ident, stack, extra_image
        leaves = {"pixels": s.Box(0, 255, (stack, 36, 36), np.uint8),
                  "clock": s.Box(-np.inf, np.inf, (2,), np.float32)}
        if extra_image:
            leaves["map"] = s.Box(0, 255, (1, 40, 40), np.uint8)
        self.observation_space = s.Dict(leaves)
        self.action_space = s.Discrete(2)
        self._t, self._episode, self._frames = 0, -1, []

    def _frame(self) -> np.ndarray:
        t, e = self._t, self._episode
        frame = ((np.arange(36 * 36) * 7 + t * 13 + e * 29 + self.ident * 101) % 256).astype(np.uint8)
        frame[:4] = [t % 256, t // 256, e % 256, self.ident]
        return frame.reshape(36, 36)

    def _obs(self) -> dict:
        obs = {"pixels": np.stack(self._frames[-self.stack:]), "clock": np.float32([self._t, self._episode])}
        if self.extra_image:
            obs["map"] = np.full((1, 40, 40), (self._t * 3 + self.ident) % 256, np.uint8)
        return obs

    def reset(self, seed: int | None = None, options: Any = None) -> tuple[dict, dict]:
        self._t, self._episode = 0, self._episode + 1
        self._frames = [self._frame()] * self.stack
        return self._obs(), {}

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        reward = float(int(action) == self._t % 2)
        self._t += 1
        self._frames.append(self._frame())
        end = self._t >= 5 + (self._episode + self.ident) % 5
        return self._obs(), reward, end and self._episode % 2 == 0, end and self._episode % 2 == 1, {}

    def close(self) -> None:
        pass


@dataclass
class PixelsDictEnvFactory:
    """A picklable factory of :class:`PixelsDictEnv`."""

    stack: int = 4
    extra_image: bool = False

    def __call__(self) -> PixelsDictEnv:
        return PixelsDictEnv(0, self.stack, self.extra_image)


def pixels_consistent(pixels: np.ndarray, clock: np.ndarray) -> np.ndarray:
    """Per row of a :class:`PixelsDictEnv` observation, whether its frames are the ones its clock says."""
    stack = pixels.shape[-3]
    t = clock[..., 0].astype(np.int64)
    ok = np.ones(t.shape, bool)
    for k in range(stack):
        step = np.maximum(t - (stack - 1 - k), 0)
        head = pixels[..., k, 0, :3].astype(np.int64)
        ok &= (head[..., 0] + 256 * head[..., 1] == step) & (head[..., 2] == clock[..., 1].astype(np.int64) % 256)
    return ok


def tensordict_policy(spec, width: int = 32):  # noqa: ANN001, ANN201 - a TorchRL user's model: a TensorDictModule
    """An actor-critic as a TorchRL user writes it: one MLP writing ``logits`` and ``state_value``."""
    from tensordict.nn import TensorDictModule, TensorDictSequential

    obs = int(np.prod(spec.obs_shape)) if spec.obs_shape else 1
    trunk = TensorDictModule(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(obs, width), torch.nn.Tanh()),
                             in_keys=["observation"], out_keys=["hidden"])
    actor = TensorDictModule(torch.nn.Linear(width, spec.action_n), in_keys=["hidden"], out_keys=["logits"])
    critic = TensorDictModule(torch.nn.Linear(width, 1), in_keys=["hidden"], out_keys=["state_value"])
    return TensorDictSequential(trunk, actor, critic)


def tensordict_actor_only(spec):  # noqa: ANN001, ANN201 - writes no state_value: PPO refuses it in one line
    from tensordict.nn import TensorDictModule

    return TensorDictModule(torch.nn.Linear(int(np.prod(spec.obs_shape)), spec.action_n),
                            in_keys=["observation"], out_keys=["logits"])


_HOOK_BATCHES = [0]


def sigterm_inside_a_c_call(batch) -> None:  # noqa: ANN001
    """A ``collector.post_collect_hook`` whose third batch meets SIGTERM as a Cython call would hand it on.

    Ray's ``CoreWorker.wait`` (where a Ray run's driver spends its time)
    turns the exception a signal handler raises during the call into
    ``SystemError: ... returned a result with an exception set``, the
    interrupt only as its context; this does the same with a real signal.
    """
    import signal as signals
    import time as clock

    _HOOK_BATCHES[0] += 1
    if _HOOK_BATCHES[0] != 3:
        return
    try:
        os.kill(os.getpid(), signals.SIGTERM)
        clock.sleep(5.0)  # the runner's handler raises here
    except BaseException:  # noqa: BLE001 - wrapped as the C extension does, context kept
        raise SystemError("<cyfunction CoreWorker.wait at 0x0> returned a result with an exception set")  # noqa: B904
    raise AssertionError("SIGTERM did not interrupt the hook")
