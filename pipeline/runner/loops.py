"""The trainer loops: on-policy (PPO) and off-policy from replay (DQN, SAC).

Both report through a :class:`Reporter`: progress bar, a metrics row every
``logger.interval`` seconds (train/*, collector/*, server/*, replay/*,
episode/*), and the stopping rule (mean return over the last episodes).
"""

from __future__ import annotations

import contextlib

import math
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from components.collector.failures import CollectorError
from components.collector.protocol import Collector
from components.episodes import EpisodeTracker, TaskEpisodes
from components.metrics import MetricsLogger
from components.trainers.base import Trainer
from pipeline.runner.checkpoints import Checkpointer


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    values: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            values[key].append(value)
    return {key: float(np.nanmean(v)) for key, v in values.items()}


class _Progress:
    """A tqdm bar on stderr when enabled, nothing otherwise."""

    def __init__(self, total: int, enabled: bool, start: int = 0) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="frame", unit_scale=True, dynamic_ncols=True,
                            mininterval=0.5, smoothing=0.1, file=sys.stderr)
        self._shown = start

    def update(self, frames: int, fps: float, mean_return: float) -> None:
        if self.bar is not None:
            self.bar.update(frames - self._shown)
            self._shown = frames
            self.bar.set_postfix_str(f"fps {fps:,.0f} | return {mean_return:.1f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def task_episodes(env_factory: Any, window: int) -> TaskEpisodes | None:
    """Per-task episode statistics for an env set (:class:`~components.env_set.EnvSet`); None for one factory."""
    tasks = getattr(env_factory, "tasks", None)
    return TaskEpisodes(tasks, env_factory.task_of(), window) if tasks is not None else None


class Reporter:
    """Progress, periodic metric rows and the stopping rule of one run."""

    def __init__(self, collector: Collector, logger: MetricsLogger, *, total_frames: int,
                 window: int, target_return: float | None, progress: bool, replay: Any = None,
                 start_frames: int = 0, elapsed: float = 0.0, tasks: TaskEpisodes | None = None,
                 deterministic: bool = False) -> None:
        self.collector, self.logger, self.replay = collector, logger, replay
        self.tracker = EpisodeTracker(window)
        #: an env set's episodes per task (episode/<task>/*), besides the run's
        self.tasks = tasks
        self.tracker_lock = threading.Lock()
        self.target_return = target_return
        self.progress = _Progress(total_frames, progress, start_frames)
        self.started = time.monotonic()
        self._elapsed_before = elapsed  # wall time of the run's earlier segments (resume)
        self.last_log, self.last_frames = self.started, start_frames
        # Besides every logger.interval seconds, a row every 1/rows_per_run of the budget (at most 4 per
        # second, not echoed): a run of a few seconds still leaves a curve, not one point.
        rows = int(getattr(logger, "rows_per_run", 0) or 0)
        self.frames_per_row = max(1, (total_frames - start_frames) // rows) if rows > 0 else None
        #: deterministic=true: rows only where the frame count crosses a multiple of frames_per_row (the same
        #: frames in every run and in a resumed one: spread over the whole budget, never by the clock)
        self.deterministic = deterministic
        if deterministic:
            self.frames_per_row = max(1, total_frames // max(rows, 1))
        self.last_echo = self.started
        self.pending: list[dict[str, float]] = []
        self.checkpointer: Checkpointer | None = None
        #: deterministic=true, set by the runner: (collector) -> a fresh one at its frames (restart points), and
        #: (frames) -> the RNGs re-seeded from (seed, frames) once a collector has started
        self.make_restart: Callable[[Collector], Collector] | None = None
        self.reseed: Callable[[int], None] | None = None
        self.restart_due = False
        #: greedy evaluation (pipeline.runner.evaluation): set by the runner with eval_interval and snapshot
        self.evaluator: Any = None
        self.eval_interval: int | None = None
        self.snapshot: Any = None  # () -> (state_dict, policy_version)
        self.target_metric = "train"
        self.last_eval: dict[str, float] | None = None
        self._eval_row: dict[str, float] | None = None
        self._next_eval = start_frames

    @property
    def elapsed(self) -> float:
        """Wall time of the whole run so far, earlier segments of a resumed run included."""
        return self._elapsed_before + time.monotonic() - self.started

    def episodes(self, batch: Any) -> None:
        """Record the episodes that ended in ``batch`` (any thread)."""
        with self.tracker_lock:
            self.tracker.add_batch(batch)
            if self.tasks is not None:
                self.tasks.add_batch(batch)

    @property
    def solved(self) -> bool:
        if self.target_return is None:
            return False
        if self.target_metric == "eval":
            return self.last_eval is not None and self.last_eval["return_mean"] >= self.target_return
        with self.tracker_lock:
            return self.tracker.full and self.tracker.mean_return >= self.target_return

    def _evaluate(self, frames: int) -> None:
        """Start an evaluation when one is due; collect a finished one (raises if it failed)."""
        result = self.evaluator.poll()
        if result is not None:
            self.last_eval = self._eval_row = result
        self._log_videos(self.evaluator.videos())
        if not self.eval_interval:
            return
        if self.deterministic:  # where frames cross a multiple (as in a resumed run), waited for: its row is fixed
            if frames // self.eval_interval > self._next_eval // self.eval_interval:
                weights, version = self.snapshot()
                if self.evaluator.start(weights, version, frames, index=2 * frames):
                    self._next_eval = frames
                    self.evaluator.wait(300.0)
                    self._evaluate(0)
        elif frames >= self._next_eval:
            weights, version = self.snapshot()
            if self.evaluator.start(weights, version, frames):
                self._next_eval = frames + self.eval_interval

    def _log_videos(self, videos: list[tuple[Any, int]]) -> None:
        for path, _ in videos:  # written: the sinks get each now, at the frames rows have reached
            self.logger.video("eval/video", path, max(self.collector.frames, self.last_frames))

    def final_evaluation(self, timeout: float = 300.0) -> None:
        """One last evaluation of the final weights, waited for, logged with the last row."""
        if self.evaluator is None:
            return
        self.evaluator.wait(timeout)
        self._evaluate(0)  # collect what was running
        if self._eval_row is not None and not self.deterministic:  # its own row: the final one would replace it
            self.flush(echo=False)
        weights, version = self.snapshot()
        frames = self.collector.frames
        if self.evaluator.start(weights, version, frames, index=2 * frames + 1 if self.deterministic else None,
                                final=True):
            self.evaluator.wait(timeout)
            self._evaluate(0)
            self._log_videos(self.evaluator.videos(wait=timeout))  # the final policy's video
            self.pending.append({})  # the final row carries it

    def step(self, metrics: dict[str, float] | None) -> bool:
        """Account for one trainer step; log when due; True once the target is reached."""
        if metrics:
            self.pending.append(metrics)
        now = time.monotonic()
        frames = self.collector.frames
        if self.evaluator is not None:
            self._evaluate(frames)
        self.progress.update(frames, frames / max(now - self.started, 1e-9), self.tracker.mean_return)
        solved = self.solved
        if self.deterministic:
            per = self.frames_per_row
            if frames // per > self.last_frames // per or solved:
                echo = now - self.last_echo >= self.logger.interval or solved
                self.flush(now, echo=echo)
                self.last_echo = now if echo else self.last_echo
        elif now - self.last_echo >= self.logger.interval or solved:
            self.flush(now)
            self.last_echo = now
        elif self.frames_per_row is not None and frames - self.last_frames >= self.frames_per_row \
                and now - self.last_log >= 0.25:
            self.flush(now, echo=False)
        if self.checkpointer is not None and not solved:
            restart = self.deterministic and self.make_restart is not None
            if restart and self.checkpointer.due(now, frames) and self.last_frames != frames:
                self.flush(now, echo=False)  # the restart point's row: the resumed run starts after it
            if self.checkpointer.maybe(now, frames) and restart:
                self.restart_due = True
        return solved

    def collector_started(self, collector: Collector) -> Collector:
        """``collector`` was started: re-seed the RNGs (deterministic=true) as a resumed run does."""
        if self.reseed is not None:
            self.reseed(collector.frames)
        return collector

    def restart_collector(self, on_batch: Callable[[Any], None] | None = None) -> Collector:
        """At a restart point (see :mod:`pipeline.runner.checkpoints`): the collector a resumed run would build."""
        self.restart_due = False
        assert self.make_restart is not None
        self.collector = collector = self.make_restart(self.collector)
        if on_batch is not None:
            collector.set_on_batch(on_batch)
        collector.start()
        return self.collector_started(collector)

    def flush(self, now: float | None = None, echo: bool = True) -> None:
        now = now if now is not None else time.monotonic()
        fps = (self.collector.frames - self.last_frames) / max(now - self.last_log, 1e-9)
        self._row(self._elapsed_before + now - self.started, fps, echo)
        self.pending, self.last_log, self.last_frames = [], now, self.collector.frames

    def _row(self, elapsed: float, fps: float, echo: bool) -> None:
        c = self.collector
        train = _mean_metrics(self.pending)
        lag_keys = ("policy_lag_mean", "policy_lag_max", "dropped_stale_frames")
        row: dict[str, Any] = {"time": elapsed}
        row.update({f"train/{k}": v for k, v in train.items() if k not in lag_keys})
        row["collector/frames"] = c.frames
        row["collector/frames_per_s"] = fps
        row["collector/policy_version"] = c.policy_version
        row.update({f"collector/{k}": train[k] for k in lag_keys if k in train})
        row.update({f"collector/{k}": v for k, v in c.worker_stats().items()})
        # Exact over this interval; undefined values (no batch served: the workers
        # had already run a batch ahead) are left out, not logged as zero.
        server = {k: v for k, v in c.server_stats(reset=True).items() if not (isinstance(v, float) and math.isnan(v))}
        row.update({f"server/{k}": v for k, v in server.items()})
        if self.replay is not None:
            row.update({f"replay/{k}": v for k, v in self.replay.stats().items()})
            per_transition = getattr(self.replay.storage, "frame_bytes_per_transition", None)
            if per_transition is not None:
                row["replay/frame_bytes_per_transition"] = per_transition
        with self.tracker_lock:
            row["episode/return_mean"] = self.tracker.mean_return
            row["episode/length_mean"] = self.tracker.mean_length
            row["episode/count"] = self.tracker.total
            if self.tasks is not None:
                row.update(self.tasks.row())
        if self._eval_row is not None:  # each evaluation once, in the first row after it finished
            row.update({f"eval/{k}": v for k, v in self._eval_row.items()})
            self._eval_row = None
        self.logger.log(row, frames=c.frames)
        if not echo:
            return
        if "policy_loss" in train:
            loss = f"loss {train['policy_loss']:+.3f}/{train['value_loss']:.3f}"
        elif "q_loss" in train:
            loss = (f"q loss {train['q_loss']:.3f} actor {train.get('actor_loss', float('nan')):+.2f} "
                    f"alpha {train.get('alpha', float('nan')):.3f}")
        elif "loss" in train:
            loss = f"loss {train['loss']:.4f} q {train['q_mean']:.2f} eps {train.get('epsilon', 0):.2f}"
        else:
            loss = f"filling replay ({len(self.replay) if self.replay is not None else 0:,} transitions)"
        evaluated = f" | eval {row['eval/return_mean']:.1f}" if "eval/return_mean" in row else ""
        line = (f"frames {c.frames:>9,} | fps {fps:>8,.0f} | return {row['episode/return_mean']:8.1f}{evaluated} | {loss} | "
                f"server batch {row.get('server/avg_batch_size', 0):.1f} p95 {row.get('server/forward_p95_ms', 0):.2f} ms"
                f" | workers {row.get('collector/bound', '?')}-bound")
        if self.progress.bar is not None:
            self.progress.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        self.progress.close()


def run_on_policy(collector: Collector, trainer: Trainer, reporter: Reporter) -> str:
    """PPO: every batch once, weights pushed after each update. Returns the stop reason."""
    reporter.collector_started(collector.start())
    # lockstep collection (deterministic=true) asks for each batch after the weights are out: no pause needed
    sync = bool(getattr(getattr(trainer, "config", None), "sync_collection", False)) and not reporter.deterministic
    clock = time.perf_counter
    batches = iter(collector)
    while True:
        started = clock()
        batch = next(batches, None)
        if batch is None:
            return "total_frames"
        reporter.episodes(batch)
        got = clock()
        # sync_collection: workers park at their next step until the new weights are out, so
        # (but for the steps they were in) the next batch is collected by the policy it trains.
        with collector.pause() if sync else contextlib.nullcontext():
            metrics = trainer.update(batch, frames=collector.frames)
            updated = clock()
            collector.update_policy_weights_(trainer.model, version=trainer.policy_version)
        pushed = clock()
        # Where the learner's time goes: a run bound by its trainer shows update_ms near the loop's.
        metrics.update(batch_wait_ms=(got - started) * 1e3, update_ms=(updated - got) * 1e3,
                       weights_push_ms=(pushed - updated) * 1e3)
        if reporter.step(metrics):
            return "target_return"
        if reporter.restart_due:
            collector = reporter.restart_collector()
            batches = iter(collector)


def run_off_policy(collector: Collector, trainer: Trainer, buffer: Any, reporter: Reporter,
                   max_batches_ahead: int = 2) -> str:
    """DQN: the collector's writer fills replay in the background; the trainer
    learns from the buffer once per collected batch (``trainer.update``).

    The writer may run at most ``max_batches_ahead`` batches ahead of
    training, which keeps the replay ratio at its configured value instead of
    drifting with whichever side is faster. Deterministic (lockstep) runs
    take turns instead: the writer asks for the next batch only once the
    trainer has learned from this one and published its weights.
    """
    written = threading.Semaphore(0)
    turns = reporter.deterministic
    room = threading.Semaphore(0 if turns else max_batches_ahead)

    def wait_for_room() -> None:
        while not room.acquire(timeout=0.1):
            if reporter.collector.closed:  # shut down, or replaced at a restart point
                raise CollectorError("the collector was shut down")

    def on_batch(batch: Any) -> None:  # the writer thread
        reporter.episodes(batch)
        if turns:
            written.release()
            wait_for_room()
            return
        wait_for_room()
        written.release()

    collector.set_on_batch(on_batch)
    reporter.collector_started(collector.start())
    while True:
        if not written.acquire(timeout=0.25):
            collector.check_writer()
            if not collector.writing:
                collector.check_writer()
                if not written.acquire(blocking=False):
                    return "total_frames"
            else:
                continue
        metrics = trainer.update(buffer, frames=collector.frames)
        collector.update_policy_weights_(trainer.model, version=trainer.policy_version)
        if not turns:
            room.release()
        if reporter.step(metrics):
            return "target_return"
        if reporter.restart_due:  # the old writer waits for room it never gets: shut down with its collector
            collector = reporter.restart_collector(on_batch)
        elif turns:  # after the row: the next batch's requests are not counted in this one's
            room.release()
