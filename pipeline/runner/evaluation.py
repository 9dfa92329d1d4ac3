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

With videos on, the first ``video.episodes`` eval envs are made with
``render_mode="rgb_array"`` (the same dynamics and seeds: the returns do
not change) and, at every ``video.every``-th evaluation and the final one,
their frames are encoded to ``<videos dir>/<frames>.mp4`` in the same
background thread. ``eval.envs`` adds named env settings, evaluated after
the main ones with the same weights and logged under ``eval/<name>/``.
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
from components.recurrent import zero_state
from components.video import FrameRecorder, env_fps, render_factory, write_mp4
from pipeline.plan.eval_settings import DEFAULT_FPS, VideoSettings

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
        video: videos of the first eval envs' episodes, written under ``videos_dir``.
    """

    def __init__(self, env_factory: Callable[[], Any], model: torch.nn.Module, *, episodes: int = 10,
                 seed: int = 0, max_steps: int = 1_000_000, mode: InteractionMode = InteractionMode.DETERMINISTIC,
                 extra: Mapping[str, Callable[[], Any]] | None = None, video: VideoSettings | None = None,
                 videos_dir: Path | None = None) -> None:
        self.env_factory = env_factory
        self.model = copy.deepcopy(model).cpu().eval()
        self.episodes, self.seed, self.max_steps = int(episodes), int(seed), int(max_steps)
        self.mode = InteractionMode.parse(mode)
        self.extra = dict(extra or {})
        self.video, self.videos_dir = video, (Path(videos_dir) if videos_dir is not None else None)
        if video is not None and videos_dir is None:
            raise ValueError("videos need a videos_dir")
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
        record = self.video is not None and (final or (self.started - 1) % self.video.every == 0)
        self._thread = threading.Thread(target=self._run, args=(state, version, frames, self.count, record),
                                        name="evaluation", daemon=True)
        self._thread.start()
        return True

    def poll(self) -> dict[str, Any] | None:
        """The newest finished evaluation's metrics (once), raising if one failed.

        A recorded video comes as ``"video": (path, frames)`` beside the float metrics.
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

    def close(self) -> None:
        self.wait(5.0)
        for env in (e for envs in self._envs.values() for e in envs):
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing must not mask anything
                pass
        self._envs = {}

    def _run(self, state: dict[str, torch.Tensor], version: int, frames: int, count: int, record: bool) -> None:
        try:
            started = time.monotonic()
            self.model.load_state_dict(state)
            recorder = FrameRecorder(self.video.episodes, self.video.max_steps) if record and self.video else None
            returns, lengths = self._play(count, self._eval_envs(""), recorder)
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
                more, more_lengths = self._play(count, self._eval_envs(name), None)
                result[f"{name}/return_mean"] = float(np.mean(more))
                result[f"{name}/return_std"] = float(np.std(more))
                result[f"{name}/length_mean"] = float(np.mean(more_lengths))
            if recorder is not None:
                fps = self.video.fps or env_fps(self._envs[""][0], DEFAULT_FPS)
                path = write_mp4(self.videos_dir / f"{int(frames)}.mp4", recorder.joined(), fps)
                result["video"] = (path, int(frames))
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
            if not name and self.video is not None:  # the recorded ones render; the rest stay as fast as they are
                for i in range(self.video.episodes):
                    factories[i] = render_factory(factories[i])
            self._envs[name] = [make() for make in factories]
            if not name:
                self._leaves = EnvSpec.from_env(self._envs[name][0]).obs_leaves  # a Dict/Tuple: packed as collected
        return self._envs[name]

    def _row(self, obs: Any) -> np.ndarray:
        return pack(self._leaves, obs) if self._leaves else np.asarray(obs)

    def _play(self, count: int, envs: list[Any], recorder: FrameRecorder | None) -> tuple[list[float], list[int]]:
        seeds = np.random.SeedSequence([self.seed, EVAL_SEED_OFFSET, count]).generate_state(self.episodes)
        return play_episodes(self.model, envs, [int(s) for s in seeds], self.mode, self._row, self.max_steps,
                             recorder)


def play_episodes(model: torch.nn.Module, envs: list[Any], seeds: list[int], mode: InteractionMode,
                  row: Callable[[Any], np.ndarray], max_steps: int,
                  recorder: FrameRecorder | None = None) -> tuple[list[float], list[int]]:
    """One episode on each env at once (env ``i`` reset with ``seeds[i]``), the policy batched over them.

    Returns the returns and lengths of the episodes that ended (all of them
    unless ``max_steps`` cut them). ``recorder`` takes each recorded env's
    frame after its reset and after every step. Also what
    ``python -m pipeline.play`` plays, so its returns are the evaluation's.
    """
    n = len(envs)
    obs = np.stack([row(env.reset(seed=int(s))[0]) for env, s in zip(envs, seeds)])
    if recorder is not None:
        for i, env in enumerate(envs):
            recorder.capture(i, env)
    live = np.ones(n, bool)
    returns, lengths = np.zeros(n), np.zeros(n, np.int64)
    modes = torch.full((n,), int(mode), dtype=torch.int8)
    space = envs[0].action_space
    low, high = getattr(space, "low", None), getattr(space, "high", None)
    steps = 0
    # a recurrent policy (components.recurrent): every episode starts from zero state, carried step to step
    state = zero_state(model, n)
    while live.any() and steps < max_steps:
        with torch.no_grad():
            out = model.act({"observation": torch.as_tensor(obs), **state}, modes)
            actions = out["action"].numpy()
            state = {k: out[f"next.{k}"] for k in state}
        for i in np.flatnonzero(live):
            action = actions[i]
            if low is not None:
                action = np.clip(action, low, high)
            elif not action.shape:  # Discrete: an int; MultiDiscrete and MultiBinary take their row as it is
                action = int(action)
            o, r, terminated, truncated, _ = envs[i].step(action)
            obs[i] = row(o)
            returns[i] += float(r)
            lengths[i] += 1
            if recorder is not None:
                recorder.capture(i, envs[i])
            if terminated or truncated:
                live[i] = False
        steps += 1
    done = ~live
    return returns[done].tolist() or returns.tolist(), lengths[done].tolist() or lengths.tolist()
