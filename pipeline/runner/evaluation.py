"""Greedy evaluation episodes on envs of their own, beside training.

The training return is the return of the *exploring* policy, averaged over
whatever episodes happened to end; what a user wants to know is how the
policy does when it acts greedily. Every ``trainer.eval_interval`` frames
the runner hands an :class:`Evaluator` a copy of the current weights (with
their policy version); a background thread plays ``eval_episodes`` whole
episodes on separate envs (seeded apart from the training envs) in
deterministic mode and reports ``eval/return_mean`` (and its std, lengths,
the version evaluated). Collection never waits for it: the collector's envs
and server are not touched, and an evaluation still running when the next
one is due is not doubled up.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from components.envs import EnvSpec
from components.interaction import InteractionMode
from components.obs_tree import pack
from components.recurrent import zero_state

#: Seeds of eval envs start here, far from the training envs' (derived from the run seed).
EVAL_SEED_OFFSET = 1_000_003


class EvaluationError(RuntimeError):
    """An evaluation env failed; the message names the env id and the error."""


class Evaluator:
    """Plays greedy episodes with snapshots of the policy in a background thread.

    Args:
        env_factory: builds one env (the training env's factory).
        model: a module of the served policy's architecture (its weights are
            replaced by each snapshot).
        episodes: episodes per evaluation (run on that many envs at once).
        seed: the run seed; eval env ``i`` of evaluation ``k`` is seeded
            from it, ``i`` and ``k``.
        max_steps: a step budget per evaluation, against envs that never end.
    """

    def __init__(self, env_factory: Callable[[], Any], model: torch.nn.Module, *, episodes: int = 10,
                 seed: int = 0, max_steps: int = 1_000_000) -> None:
        self.env_factory = env_factory
        self.model = copy.deepcopy(model).cpu().eval()
        self.episodes, self.seed, self.max_steps = int(episodes), int(seed), int(max_steps)
        self._envs: list[Any] = []
        self._leaves: tuple[Any, ...] = ()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._result: dict[str, float] | None = None
        self._error: BaseException | None = None
        self.count = 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, weights: Mapping[str, torch.Tensor], version: int, frames: int, index: int | None = None) -> bool:
        """Evaluate these weights in the background; False (nothing started) while one still runs.

        ``index`` picks the eval envs' seeds (default: the count of evaluations this evaluator started; a
        deterministic run passes one derived from ``frames``, so a resumed run seeds as the uninterrupted one).
        """
        if self.busy:
            return False
        state = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
        self.count = self.count + 1 if index is None else int(index)
        self._thread = threading.Thread(target=self._run, args=(state, version, frames, self.count),
                                        name="evaluation", daemon=True)
        self._thread.start()
        return True

    def poll(self) -> dict[str, float] | None:
        """The newest finished evaluation's metrics (once), raising if one failed."""
        with self._lock:
            if self._error is not None:
                error, self._error = self._error, None
                raise EvaluationError(f"evaluation failed: {type(error).__name__}: {error}") from None
            result, self._result = self._result, None
        return result

    def wait(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        self.wait(5.0)
        for env in self._envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing must not mask anything
                pass
        self._envs = []

    def _run(self, state: dict[str, torch.Tensor], version: int, frames: int, count: int) -> None:
        try:
            started = time.monotonic()
            self.model.load_state_dict(state)
            returns, lengths = self._play(count)
            result = {"return_mean": float(np.mean(returns)), "return_std": float(np.std(returns)),
                      "length_mean": float(np.mean(lengths)), "episodes": float(len(returns)),
                      "policy_version": float(version), "frames": float(frames),
                      "seconds": time.monotonic() - started}
            tasks = getattr(self.env_factory, "tasks", None)  # an env set: its envs took the tasks in turn
            if tasks is not None and len(returns) == self.episodes:
                for t, name in enumerate(tasks):
                    mine = returns[t::len(tasks)]
                    if mine:
                        result[f"{name}/return_mean"] = float(np.mean(mine))
            with self._lock:
                self._result = result
        except BaseException as err:  # noqa: BLE001 - handed to the runner by poll()
            with self._lock:
                self._error = err

    def _row(self, obs: Any) -> np.ndarray:
        return pack(self._leaves, obs) if self._leaves else np.asarray(obs)

    def _play(self, count: int) -> tuple[list[float], list[int]]:
        if not self._envs:
            cycle = getattr(self.env_factory, "cycle", None)  # an env set: its tasks in turn
            factories = cycle(self.episodes) if cycle is not None else [self.env_factory] * self.episodes
            self._envs = [make() for make in factories]
            self._leaves = EnvSpec.from_env(self._envs[0]).obs_leaves  # a Dict/Tuple: packed as the collector does
        seeds = np.random.SeedSequence([self.seed, EVAL_SEED_OFFSET, count]).generate_state(self.episodes)
        obs = np.stack([self._row(env.reset(seed=int(s))[0]) for env, s in zip(self._envs, seeds)])
        live = np.ones(self.episodes, bool)
        returns, lengths = np.zeros(self.episodes), np.zeros(self.episodes, np.int64)
        modes = torch.full((self.episodes,), int(InteractionMode.DETERMINISTIC), dtype=torch.int8)
        space = self._envs[0].action_space
        low, high = getattr(space, "low", None), getattr(space, "high", None)
        steps = 0
        # a recurrent policy (components.recurrent): every episode starts from zero state, carried step to step
        state = zero_state(self.model, self.episodes)
        while live.any() and steps < self.max_steps:
            with torch.no_grad():
                out = self.model.act({"observation": torch.as_tensor(obs), **state}, modes)
                actions = out["action"].numpy()
                state = {k: out[f"next.{k}"] for k in state}
            for i in np.flatnonzero(live):
                action = actions[i]
                if low is not None:
                    action = np.clip(action, low, high)
                elif not action.shape:  # Discrete: an int; MultiDiscrete and MultiBinary take their row as it is
                    action = int(action)
                o, r, terminated, truncated, _ = self._envs[i].step(action)
                obs[i] = self._row(o)
                returns[i] += float(r)
                lengths[i] += 1
                if terminated or truncated:
                    live[i] = False
            steps += 1
        done = ~live
        return returns[done].tolist() or returns.tolist(), lengths[done].tolist() or lengths.tolist()
