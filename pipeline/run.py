"""The runner: validated config -> plan -> collector graph -> trainer loop -> outputs.

Everything the run writes lives in Hydra's run directory: ``metrics.jsonl``,
the wandb run (``wandb/``), ``checkpoint.pt`` and Hydra's own ``.hydra/``.
Every exit path (end of budget, target reached, error, Ctrl-C, SIGTERM) goes
through the same ``finally``: the collector's threads and processes are
joined, the logger is closed and the checkpoint is written atomically.
"""

from __future__ import annotations

import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from components.checkpoint import save_checkpoint
from components.collector.collector import AsyncBatchedCollector, CollectorError
from components.envs import EnvConfigError, probe_env_spec
from components.episodes import EpisodeTracker
from components.metrics import MetricsLogger
from components.models import ModelSpec
from components.trainers.ppo import PPOTrainer
from pipeline.plan import Machine, Plan, resolve_plan
from pipeline.validate import ConfigError, validate

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130


class Interrupted(Exception):
    """SIGTERM/SIGINT arrived; the run stops cleanly."""


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def _echo(message: str, bar: Any = None) -> None:
    if bar is not None:
        bar.write(message)
    else:
        print(message, flush=True)


class _Progress:
    """A tqdm bar on stderr when enabled, nothing otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="frame", unit_scale=True, dynamic_ncols=True,
                            mininterval=0.5, smoothing=0.1, file=sys.stderr)

    def update(self, frames: int, fps: float, mean_return: float) -> None:
        if self.bar is not None:
            self.bar.update(frames)
            self.bar.set_postfix_str(f"fps {fps:,.0f} | return {mean_return:.1f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_parts(cfg: DictConfig, plan: Plan) -> tuple[Any, Any, ModelSpec, PPOTrainer]:
    """Instantiate the leaf objects: env factory, env spec, model spec, trainer."""
    env_factory = instantiate(cfg.env.factory, _convert_="all")
    try:
        env_spec = probe_env_spec(env_factory)
    except EnvConfigError as err:
        raise ConfigError(f"env.id={cfg.env.id!r}: {err}") from None
    model_kwargs = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(model_kwargs, dict)
    target = str(model_kwargs.pop("_target_"))
    model_spec = ModelSpec(target, model_kwargs)
    try:
        model = model_spec.build(env_spec)
    except ValueError as err:
        raise ConfigError(f"model.encoder={cfg.model.encoder!r}: {err}") from None
    algo = instantiate(cfg.trainer, _convert_="all")
    trainer = PPOTrainer(model, algo, device=plan.trainer_device)
    return env_factory, env_spec, model_spec, trainer


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    sums: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            sums[key].append(value)
    return {key: float(np.nanmean(values)) for key, values in sums.items()}


def run(cfg: DictConfig, run_dir: Path) -> int:
    """Run one training job in ``run_dir``; returns the process exit code."""
    machine = Machine.detect()
    validate(cfg, cuda_available=machine.cuda, cuda_count=machine.cuda_count)
    plan = resolve_plan(cfg, machine)
    print(plan, flush=True)
    for name in ("checkpoint.pt", "metrics.jsonl"):
        if (run_dir / name).exists():
            raise ConfigError(f"hydra.run.dir={str(run_dir)!r}: already holds a run ({name}); pick a new directory")
    torch.set_num_threads(int(cfg.torch_threads))
    torch.manual_seed(int(cfg.seed))
    np.random.seed(int(cfg.seed))

    env_factory, env_spec, model_spec, trainer = build_parts(cfg, plan)
    algo = trainer.config
    collector = AsyncBatchedCollector(
        env_factory, model_spec, plan.graph,
        frames_per_batch=algo.frames_per_batch, total_frames=algo.total_frames,
        seed=int(cfg.seed), server_config=plan.server, env_spec=env_spec,
    )
    collector.update_policy_weights_(trainer.model)  # served from the first request
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    logger = instantiate(cfg.logger, run_dir=run_dir, name=run_dir.name, run_config=resolved,
                         _convert_="all", _recursive_=False)
    assert isinstance(logger, MetricsLogger)

    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    tracker = EpisodeTracker(algo.target_window)
    progress = _Progress(algo.total_frames, bool(cfg.progress))
    started = time.monotonic()
    last_log, last_frames = started, 0
    pending: list[dict[str, float]] = []
    stop_reason, code = "total_frames", EXIT_OK
    try:
        collector.start()
        for batch in collector:
            tracker.add_batch(batch)
            pending.append(trainer.update(batch))
            collector.update_policy_weights_(trainer.model)
            now = time.monotonic()
            progress.update(batch.numel(), collector.frames / max(now - started, 1e-9), tracker.mean_return)
            solved = (algo.target_return is not None and tracker.full
                      and tracker.mean_return >= algo.target_return)
            if now - last_log >= logger.interval or solved:
                _log_row(logger, collector, tracker, pending, now - started,
                         (collector.frames - last_frames) / max(now - last_log, 1e-9), progress.bar)
                pending, last_log, last_frames = [], now, collector.frames
            if solved:
                stop_reason = "target_return"
                break
    except (KeyboardInterrupt, Interrupted) as err:
        stop_reason, code = f"interrupted ({err or 'SIGINT'})", EXIT_INTERRUPTED
    except CollectorError as err:
        stop_reason, code = f"failed: {err}", EXIT_FAILED
    finally:
        progress.close()
        # No second Ctrl-C may cut the clean-up short.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        try:
            collector.shutdown()
            wall = time.monotonic() - started
            if pending:
                fps = (collector.frames - last_frames) / max(time.monotonic() - last_log, 1e-9)
                _log_row(logger, collector, tracker, pending, wall, fps, None)
            checkpoint = None
            if cfg.checkpoint:
                checkpoint = save_checkpoint(run_dir / "checkpoint.pt", {
                    **trainer.state_dict(),
                    "config": resolved,
                    "model_spec": {"target": model_spec.target, "kwargs": model_spec.kwargs},
                    "env_spec": env_spec,
                    "episode_return_mean": tracker.mean_return,
                    "stop_reason": stop_reason,
                })
            summary = {
                "frames": collector.frames,
                "wall_time_s": round(wall, 3),
                "stop_reason": stop_reason,
                "episode/return_mean": tracker.mean_return,
                "episode/count": tracker.total,
                "solved": stop_reason == "target_return",
            }
            logger.summary(summary)
            logger.close(exit_code=code)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print(f"{stop_reason}: {collector.frames} frames in {wall:.1f} s, mean return "
          f"{tracker.mean_return:.1f} over the last {len(tracker.returns)} episodes"
          + (f"; checkpoint {checkpoint}" if checkpoint else ""), flush=True)
    if code == EXIT_FAILED:
        print(f"error: {stop_reason.removeprefix('failed: ')}", file=sys.stderr, flush=True)
    return code


def _log_row(logger: MetricsLogger, collector: AsyncBatchedCollector, tracker: EpisodeTracker,
             pending: list[dict[str, float]], elapsed: float, fps: float, bar: Any) -> None:
    train = _mean_metrics(pending)
    row: dict[str, Any] = {"time": elapsed}
    row.update({f"train/{k}": v for k, v in train.items() if not k.startswith("policy_lag") and k != "dropped_stale_frames"})
    row["collector/frames"] = collector.frames
    row["collector/frames_per_s"] = fps
    row["collector/policy_version"] = collector.policy_version
    for key in ("policy_lag_mean", "policy_lag_max", "dropped_stale_frames"):
        if key in train:
            row[f"collector/{key}"] = train[key]
    row.update({f"collector/{k}": v for k, v in collector.worker_stats().items()})
    row.update({f"server/{k}": v for k, v in collector.server_stats(reset=True).items()})
    row["episode/return_mean"] = tracker.mean_return
    row["episode/length_mean"] = tracker.mean_length
    row["episode/count"] = tracker.total
    logger.log(row, frames=collector.frames)
    _echo(
        f"frames {collector.frames:>9,} | fps {fps:>8,.0f} | return {tracker.mean_return:8.1f} | "
        f"loss {train.get('policy_loss', float('nan')):+.3f}/{train.get('value_loss', float('nan')):.3f} | "
        f"server batch {row.get('server/avg_batch_size', 0):.1f} p95 {row.get('server/forward_p95_ms', 0):.2f} ms | "
        f"workers {row.get('collector/bound', '?')}-bound",
        bar,
    )


def main_from_hydra(cfg: DictConfig) -> None:
    """The Hydra task: one-line errors and exit codes, no tracebacks for user mistakes."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        code = run(cfg, run_dir)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    if code != EXIT_OK:
        sys.exit(code)
