"""Greedy evaluation episodes on envs of their own, beside training.

The training return is the return of the *exploring* policy, averaged over
whatever episodes happened to end; what a user wants to know is how the
policy does when it acts greedily. Every ``eval.interval`` frames the
runner hands an :class:`Evaluator` a copy of the current weights (with
their policy version); a background thread plays ``eval.episodes`` whole
episodes on separate envs (seeded apart from the training envs) in
``eval.mode`` (deterministic by default) and reports ``eval/return_mean``
(and its std, lengths, the version evaluated). Collection never waits for
it: the collector's envs and server are not touched, and an evaluation
still running when the next one is due is not doubled up.

With videos on, every ``video.every``-th evaluation and the final one
also hand their weights and the seeds of their first ``video.episodes``
envs to a :class:`~pipeline.runner.video_recorder.VideoRecorder`, a niced
process that replays those episodes on rendering envs and encodes
``<run dir>/videos/<frames>.mp4`` (nothing renders in the driver).
``eval.envs`` adds named env settings, evaluated after the main ones with
the same weights and logged under ``eval/<name>/``.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components.envs import EnvSpec
from components.interaction import InteractionMode
from components.obs_tree import pack
from pipeline.runner.play_loop import play_episodes
from pipeline.runner.video_recorder import FINAL_VIDEO_TIMEOUT_S

#: Seeds of eval envs start here, far from the training envs' (derived from the run seed).
EVAL_SEED_OFFSET = 1_000_003


class EvaluationError(RuntimeError):
    """An evaluation env failed; the message names the env id and the error."""


class Evaluator:
    """Plays evaluation episodes with snapshots of the policy in a background thread.

    Args:
        env_factory: builds one env (the training env's factory).
        model: a module of the served policy's architecture (its weights are
            replaced by each snapshot).
        episodes: episodes per evaluation (run on that many envs at once).
        seed: the run seed; eval env ``i`` of evaluation ``k`` is seeded
            from it, ``i`` and ``k``.
        max_steps: a step budget per evaluation, against envs that never end.
        mode: how the policy acts (deterministic: greedy).
        extra: more env factories by name, each evaluated with the same weights (``<name>/return_mean``).
        recorder: makes the videos (:class:`~pipeline.runner.video_recorder.VideoRecorder`); None: no videos.
    """

    def __init__(self, env_factory: Callable[[], Any], model: torch.nn.Module, *, episodes: int = 10,
                 seed: int = 0, max_steps: int = 1_000_000, mode: InteractionMode = InteractionMode.DETERMINISTIC,
                 extra: Mapping[str, Callable[[], Any]] | None = None, recorder: Any = None) -> None:
        self.env_factory = env_factory
        self.model = copy.deepcopy(model).cpu().eval()
        self.episodes, self.seed, self.max_steps = int(episodes), int(seed), int(max_steps)
        self.mode = InteractionMode.parse(mode)
        self.extra = dict(extra or {})
        self.recorder = recorder
        self.video = recorder.settings if recorder is not None else None
        self._envs: dict[str, list[Any]] = {}
        self._leaves: tuple[Any, ...] = ()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self.count = 0
        self.started = 0  # evaluations started: every video.every-th records

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, weights: Mapping[str, torch.Tensor], version: int, frames: int, index: int | None = None,
              final: bool = False) -> bool:
        """Evaluate these weights in the background; False (nothing started) while one still runs.

        ``index`` picks the eval envs' seeds (default: the count of evaluations this evaluator started; a
        deterministic run passes one derived from ``frames``, so a resumed run seeds as the uninterrupted one).
        ``final``: the last evaluation of a run, which always records a video when videos are on.
        """
        if self.busy:
            return False
        state = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
        self.count = self.count + 1 if index is None else int(index)
        self.started += 1
        if self.video is not None and (final or (self.started - 1) % self.video.every == 0):
            seeds = self._seeds(self.count)[: self.video.episodes]  # the first eval envs' episodes
            self.recorder.submit(state, seeds, frames, wait=FINAL_VIDEO_TIMEOUT_S if final else 0.0)
        self._thread = threading.Thread(target=self._run, args=(state, version, frames, self.count),
                                        name="evaluation", daemon=True)
        self._thread.start()
        return True

    def poll(self) -> dict[str, Any] | None:
        """The newest finished evaluation's metrics (once), raising if one failed.

        """
        with self._lock:
            if self._error is not None:
                error, self._error = self._error, None
                raise EvaluationError(f"evaluation failed: {type(error).__name__}: {error}") from None
            result, self._result = self._result, None
        return result

    def wait(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def videos(self, wait: float = 0.0) -> list[tuple[Path, int]]:
        """Videos written since the last call, ``(path, frames)``; ``wait``: for the one being made first."""
        if self.recorder is None:
            return []
        if wait:
            self.recorder.wait(wait)
        return self.recorder.poll()

    def close(self) -> None:
        self.wait(5.0)
        if self.recorder is not None:
            self.recorder.close()
        for env in (e for envs in self._envs.values() for e in envs):
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing must not mask anything
                pass
        self._envs = {}

    def _run(self, state: dict[str, torch.Tensor], version: int, frames: int, count: int) -> None:
        try:
            started = time.monotonic()
            self.model.load_state_dict(state)
            returns, lengths = self._play(count, self._eval_envs(""))
            result: dict[str, Any] = {
                "return_mean": float(np.mean(returns)), "return_std": float(np.std(returns)),
                "length_mean": float(np.mean(lengths)), "episodes": float(len(returns)),
                "policy_version": float(version), "frames": float(frames), "seed_index": float(count)}
            tasks = getattr(self.env_factory, "tasks", None)  # an env set: its envs took the tasks in turn
            if tasks is not None and len(returns) == self.episodes:
                for t, name in enumerate(tasks):
                    mine = returns[t::len(tasks)]
                    if mine:
                        result[f"{name}/return_mean"] = float(np.mean(mine))
            for name in self.extra:
                more, more_lengths = self._play(count, self._eval_envs(name))
                result[f"{name}/return_mean"] = float(np.mean(more))
                result[f"{name}/return_std"] = float(np.std(more))
                result[f"{name}/length_mean"] = float(np.mean(more_lengths))
            result["seconds"] = time.monotonic() - started
            with self._lock:
                self._result = result
        except BaseException as err:  # noqa: BLE001 - handed to the runner by poll()
            with self._lock:
                self._error = err

    def _eval_envs(self, name: str) -> list[Any]:
        """The envs of the main evaluation (``""``) or of one named in ``extra``, made once."""
        if name not in self._envs:
            factory = self.extra[name] if name else self.env_factory
            cycle = getattr(factory, "cycle", None)  # an env set: its tasks in turn
            factories = list(cycle(self.episodes) if cycle is not None else [factory] * self.episodes)
            self._envs[name] = [make() for make in factories]
            if not name:
                self._leaves = EnvSpec.from_env(self._envs[name][0]).obs_leaves  # a Dict/Tuple: packed as collected
        return self._envs[name]

    def _row(self, obs: Any) -> np.ndarray:
        return pack(self._leaves, obs) if self._leaves else np.asarray(obs)

    def _seeds(self, count: int) -> list[int]:
        return [int(s) for s in np.random.SeedSequence([self.seed, EVAL_SEED_OFFSET, count]).generate_state(
            self.episodes)]

    def _play(self, count: int, envs: list[Any]) -> tuple[list[float], list[int]]:
        return play_episodes(self.model, envs, self._seeds(count), self.mode, self._row, self.max_steps,
                             obs_leaves=self._leaves)
