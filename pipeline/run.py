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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from components.checkpoint import save_checkpoint
from components.collector.collector import AsyncBatchedCollector, CollectorError
from components.envs import EnvConfigError, probe_env_spec
from components.metrics import MetricsLogger
from components.models import ModelSpec
from components.trainers.dqn import DQNTrainer
from components.trainers.ppo import PPOTrainer
from pipeline.loops import Reporter, run_off_policy, run_on_policy
from pipeline.plan import Machine, Plan, resolve_plan
from pipeline.validate import ConfigError, validate

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130


class Interrupted(Exception):
    """SIGTERM/SIGINT arrived; the run stops cleanly."""


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def build_parts(cfg: DictConfig, plan: Plan) -> tuple[Any, Any, ModelSpec, Any]:
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
    if cfg.trainer.name == "dqn" and env_spec.action_kind != "discrete":
        raise ConfigError(f"trainer.name='dqn': env.id={cfg.env.id!r} has continuous actions; "
                          "DQN needs discrete ones (use trainer=ppo)")
    try:
        model = model_spec.build(env_spec)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"model.encoder={cfg.model.encoder!r}: {err}") from None
    algo = instantiate(cfg.trainer, _convert_="all")
    trainer_class = DQNTrainer if algo.name == "dqn" else PPOTrainer
    return env_factory, env_spec, model_spec, trainer_class(model, algo, device=plan.trainer_device)


def build_replay(cfg: DictConfig, run_dir: Path, env_spec: Any, algo: Any, device: str = "cpu") -> tuple[Any, Any]:
    """The replay buffer and the n-step transform the writer applies (or None, None)."""
    r = cfg.replay
    if r.kind == "none":
        return None, None
    from components.replay.buffer import ReplayBuffer
    from components.replay.frames import FrameStackStorage
    from components.replay.nstep import NStepReturns
    from components.replay.storage import TensorStorage

    path = run_dir / "replay" if r.storage == "disk" else None
    stacks = env_spec.obs_dtype == "uint8" and len(env_spec.obs_shape) == 3
    dedup = {"auto": stacks, "true": True, "false": False}[str(r.frame_dedup).lower()]
    if dedup and not stacks:
        raise ConfigError(f"replay.frame_dedup={r.frame_dedup}: observations {env_spec.obs_shape} "
                          f"{env_spec.obs_dtype} are not uint8 frame stacks")
    if dedup:
        storage: Any = FrameStackStorage(int(r.capacity), path=path)
    else:
        storage = TensorStorage(int(r.capacity), device=device if path is None else "cpu", path=path)
    updates = max(1, algo.total_frames // algo.frames_per_batch * algo.updates_per_batch)
    buffer = ReplayBuffer(storage, sampler=str(r.kind), alpha=float(r.alpha), beta=float(r.beta),
                          beta_steps=updates, eps=float(r.eps), max_policy_lag=r.max_policy_lag, seed=int(cfg.seed))
    return buffer, NStepReturns(int(algo.n_step), float(algo.gamma))


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
    buffer, nstep = build_replay(cfg, run_dir, env_spec, algo, plan.storing_device)
    collector = AsyncBatchedCollector(
        env_factory, model_spec, plan.graph,
        frames_per_batch=algo.frames_per_batch, total_frames=algo.total_frames,
        seed=int(cfg.seed), server_config=plan.server, env_spec=env_spec,
        replay_buffer=buffer, postproc=nstep, storing_device=plan.storing_device,
    )
    collector.update_policy_weights_(trainer.model)  # served from the first request
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    logger = instantiate(cfg.logger, run_dir=run_dir, name=run_dir.name, run_config=resolved,
                         _convert_="all", _recursive_=False)
    assert isinstance(logger, MetricsLogger)
    reporter = Reporter(collector, logger, total_frames=algo.total_frames, window=algo.target_window,
                        target_return=algo.target_return, progress=bool(cfg.progress), replay=buffer)

    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop_reason, code = "total_frames", EXIT_OK
    try:
        if buffer is None:
            stop_reason = run_on_policy(collector, trainer, reporter)
        else:
            stop_reason = run_off_policy(collector, trainer, buffer, reporter)
    except (KeyboardInterrupt, Interrupted) as err:
        stop_reason, code = f"interrupted ({err or 'SIGINT'})", EXIT_INTERRUPTED
    except CollectorError as err:
        stop_reason, code = f"failed: {err}", EXIT_FAILED
    finally:
        reporter.close()
        # No second Ctrl-C may cut the clean-up short.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        try:
            collector.shutdown()
            wall = time.monotonic() - reporter.started
            if reporter.pending or reporter.last_frames != collector.frames:
                reporter.flush(echo=False)  # the last row describes the final state
            checkpoint = None
            if cfg.checkpoint:
                state = {
                    **trainer.state_dict(),
                    "config": resolved,
                    "model_spec": {"target": model_spec.target, "kwargs": model_spec.kwargs},
                    "env_spec": env_spec,
                    "episode_return_mean": reporter.tracker.mean_return,
                    "stop_reason": stop_reason,
                }
                if buffer is not None and cfg.replay.storage == "disk":
                    state["replay"] = buffer.state_dict()
                    state["nstep"] = nstep.state_dict()
                checkpoint = save_checkpoint(run_dir / "checkpoint.pt", state)
            tracker = reporter.tracker
            logger.summary({
                "frames": collector.frames,
                "wall_time_s": round(wall, 3),
                "stop_reason": stop_reason,
                "episode/return_mean": tracker.mean_return,
                "episode/count": tracker.total,
                "solved": stop_reason == "target_return",
            })
            logger.close(exit_code=code)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    tracker = reporter.tracker
    print(f"{stop_reason}: {collector.frames} frames in {wall:.1f} s, mean return "
          f"{tracker.mean_return:.1f} over the last {len(tracker.returns)} episodes"
          + (f"; checkpoint {checkpoint}" if checkpoint else ""), flush=True)
    if code == EXIT_FAILED:
        print(f"error: {stop_reason.removeprefix('failed: ')}", file=sys.stderr, flush=True)
    return code


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
