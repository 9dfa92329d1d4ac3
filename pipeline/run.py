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
from components.trainers.base import Trainer
from pipeline.loops import Reporter, run_off_policy, run_on_policy
from pipeline.plan import Machine, Plan, resolve_plan
from pipeline.validate import ConfigError, validate

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130


class Interrupted(Exception):
    """SIGTERM/SIGINT arrived; the run stops cleanly."""


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def build_env(cfg: DictConfig) -> tuple[Any, Any]:
    """The env factory and the spec of one env it makes (an unknown id is a config error)."""
    env_factory = instantiate(cfg.env.factory, _convert_="all")
    try:
        return env_factory, probe_env_spec(env_factory)
    except EnvConfigError as err:
        raise ConfigError(f"env.id={cfg.env.id!r}: {err}") from None


def build_learner(cfg: DictConfig, env_spec: Any, plan: Plan) -> tuple[ModelSpec, Trainer]:
    """The model spec (what the server rebuilds) and the trainer owning the learner's copy.

    The trainer comes from the trainer node's ``_target_`` (its other keys are
    the hyper-parameters), so a new algorithm is a new config, not a branch here.
    """
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
    trainer = instantiate(cfg.trainer, model=model, device=plan.trainer_device,
                          policy_version=int(cfg.collector.policy_version), _convert_="all")
    if not isinstance(trainer, Trainer):
        raise ConfigError(f"trainer._target_={cfg.trainer._target_!r}: not a Trainer "
                          "(needs on_policy, policy_version, update, state_dict)")
    return model_spec, trainer


def post_collect_hook(cfg: DictConfig) -> Any:
    """The callable ``collector.post_collect_hook`` names (None when unset)."""
    path = cfg.collector.post_collect_hook
    if path is None:
        return None
    from hydra.utils import get_method

    try:
        return get_method(str(path))
    except Exception as err:  # noqa: BLE001 - any import problem is the user's path
        raise ConfigError(f"collector.post_collect_hook={path!r}: not an importable callable "
                          f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None


def build_replay(cfg: DictConfig, run_dir: Path, plan: Plan, algo: Any) -> tuple[Any, Any]:
    """The replay buffer and the n-step transform the writer applies (or None, None)."""
    r = cfg.replay
    if r.kind == "none":
        return None, None
    from components.replay.buffer import ReplayBuffer
    from components.replay.frames import FrameStackStorage
    from components.replay.nstep import NStepReturns
    from components.replay.storage import TensorStorage

    path = run_dir / "replay" if r.storage == "disk" else None
    if plan.frame_dedup:
        storage: Any = FrameStackStorage(int(r.capacity), path=path)
    else:
        storage = TensorStorage(int(r.capacity), device=plan.storing_device if path is None else "cpu", path=path)
    updates = max(1, algo.total_frames // algo.frames_per_batch * algo.updates_per_batch)
    buffer = ReplayBuffer(storage, sampler=str(r.kind), alpha=float(r.alpha), beta=float(r.beta),
                          beta_steps=updates, eps=float(r.eps), max_policy_lag=r.max_policy_lag, seed=int(cfg.seed))
    return buffer, NStepReturns(int(algo.n_step), float(algo.gamma))


def run(cfg: DictConfig, run_dir: Path) -> int:
    """Run one training job in ``run_dir``; returns the process exit code."""
    machine = Machine.detect()
    validate(cfg, cuda_available=machine.cuda, cuda_count=machine.cuda_count)
    hook = post_collect_hook(cfg)
    env_factory, env_spec = build_env(cfg)
    plan = resolve_plan(cfg, machine, env_spec)
    print(plan, flush=True)
    for name in ("checkpoint.pt", "metrics.jsonl"):
        if (run_dir / name).exists():
            raise ConfigError(f"hydra.run.dir={str(run_dir)!r}: already holds a run ({name}); pick a new directory")
    torch.set_num_threads(int(cfg.torch_threads))
    torch.manual_seed(int(cfg.seed))
    np.random.seed(int(cfg.seed))

    model_spec, trainer = build_learner(cfg, env_spec, plan)
    algo = trainer.config
    buffer, nstep = build_replay(cfg, run_dir, plan, algo)
    c = cfg.collector
    collector = AsyncBatchedCollector(
        env_factory, model_spec, plan.graph,
        frames_per_batch=algo.frames_per_batch, total_frames=algo.total_frames,
        seed=int(cfg.seed), server_config=plan.server, env_spec=env_spec,
        replay_buffer=buffer, postproc=nstep, storing_device=plan.storing_device,
        policy_version=trainer.policy_version, stall_timeout=c.stall_timeout,
        yield_completed_trajectories=bool(c.yield_completed_trajectories),
        reset_at_each_iter=bool(c.reset_at_each_iter), post_collect_hook=hook,
        driver_affinity=list(c.driver_affinity) if c.driver_affinity else None,
    )
    # version 0: the initial weights, served from the first request
    collector.update_policy_weights_(trainer.model, version=trainer.policy_version)
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
        if trainer.on_policy:
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
