"""The runner: validated config -> plan -> collector graph -> trainer loop -> outputs.

Everything the run writes lives in its run directory, claimed atomically
before anything is written (:mod:`pipeline.runner.rundir`): ``metrics.jsonl``, the
wandb run (``wandb/``), ``checkpoint.pt`` (written every
``checkpoint.interval`` seconds and at the end) and ``.hydra/``. Every exit
path (end of budget, target reached, error, Ctrl-C, SIGTERM, at start-up
too) goes through one ``finally``: the collector's threads and processes are
joined, the checkpoint is written atomically (unless the failure was
numerical: then the last good checkpoint is kept), then the summary row, and
only then are the sinks closed, within ``logger.wandb_timeout`` (a sink that
does not answer is abandoned; a second Ctrl-C abandons it at once). Each step
is bounded and a failure in one is one line that does not skip the next.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from components.collector.failures import CollectorError
from components.lifecycle import name_semaphores_by_pid, spawn_from_any_process, sweep_stale_semaphores
from components.metrics import MetricsLogger
from components.threads import pin_pools, report_pools
from components.trainers.base import NonFiniteError
from pipeline.runner.budgets import check_budgets
from pipeline.runner.collection import build_collector
from pipeline.runner.evaluation_setup import EvalSetup, EvaluationError, build_evaluator, prepare_evaluation
from pipeline.runner.learner import ReplayInCheckpoints, build_learner, build_replay, final_write_bytes, \
    post_collect_hook
from pipeline.runner.checkpoints import Checkpointer, close_open_windows, restart_collector
from pipeline.runner.loops import Reporter, run_off_policy, run_on_policy, task_episodes
from pipeline.plan import Choice, Machine, Plan
from pipeline.plan.inputs import family_config, plan_config
from pipeline.plan.ray import connect_ray
from pipeline.plan.presets import preset_line
from pipeline.runner.reproducibility import apply_determinism, env_seed_at, reseed, summary_row
from pipeline.runner.resume import rewind_metrics
from pipeline.runner.run_lock import LOCK, claim_run_dir
from pipeline.runner.rundir import DiskReserve, apply_mode, write_hydra_files
from pipeline.runner.signals import (Interrupted, catch_signals, exit_interrupted, ignore_signals, raise_if_pending,
                                     interrupt_of, signals_raise)
from pipeline.runner.state import load_run_state, restore_episodes, run_state, save_run_state, set_rng_state
from pipeline.runner.sweep import cpu_share
from pipeline.plan.validate import ConfigError, validate

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130


def run(cfg: DictConfig, run_dir: Path, hydra_files: tuple[Any, Any, list[str]] | None = None,
        sweep_group: str | None = None, concurrent_jobs: int = 1, preset: Choice | None = None) -> int:
    """Run one training job in ``run_dir``; returns the process exit code.

    ``hydra_files`` (the task config, Hydra's config, the overrides) are
    written to ``.hydra/`` once the directory is claimed; the overrides also
    tag the wandb run and label the TensorBoard HParams. ``sweep_group``
    (the sweep directory's name, for a job of a multirun) groups the
    sweep's wandb runs. ``concurrent_jobs`` sweep jobs share this machine:
    the graph is sized for this job's share of the CPUs. ``preset`` (the
    hyper-parameter preset Hydra applied, see :mod:`pipeline.plan.presets`) is
    printed in the plan.
    """
    previous = catch_signals()
    claimed = False
    claim = umask = cluster = None
    try:
        raise_if_pending()  # a Ctrl-C that a library swallowed while we were importing it
        # before any child (Ray, workers, sinks) or file exists: they all inherit it (pipeline/runner/rundir.py)
        umask = apply_mode(str(OmegaConf.select(cfg, "rundir.mode", default="private")))
        sweep_stale_semaphores()  # what runs killed during their start-up left in /dev/shm
        spawn_from_any_process()
        name_semaphores_by_pid()
        machine = Machine.detect()
        if concurrent_jobs > 1:
            share = cpu_share(machine.cpus, concurrent_jobs)
            machine = replace(machine, cpus=share, total_cpus=machine.cpus, sweep_jobs=concurrent_jobs)
        validate(cfg, cuda_available=machine.cuda, cuda_count=machine.cuda_count)
        # The driver's pools, before the probes time the policy with them; children inherit the sizes
        # unless they are started with their own (components/threads.py).
        pin_pools(int(cfg.torch_threads))
        hook = post_collect_hook(cfg)
        planned = plan_config(cfg, machine)
        plan, env_factory, env_spec = planned.plan, planned.env_factory, planned.env_spec
        evaluation = prepare_evaluation(cfg, env_factory, env_spec)  # its bad input is one line, nothing written
        if preset:
            plan = plan.with_choice("preset", preset)
        hosts = None
        if str(cfg.workers.backend) == "ray":
            cluster, plan, hosts = connect_ray(cfg, plan, machine)
        check_budgets(cfg, plan, env_spec, run_dir)
        raise_if_pending()
        resume = cfg.resume is not None
        claim = claim_run_dir(run_dir, resume=resume,
                              take_over=bool(OmegaConf.select(cfg, "rundir.take_over", default=False)))
        claimed = True
        if hydra_files is not None:
            write_hydra_files(run_dir, *hydra_files)
        print(plan, flush=True)
        job = JobInfo(list(hydra_files[2]) if hydra_files is not None else [], sweep_group)
        return _train(cfg, run_dir, plan, env_factory, env_spec, hook, resume, previous, job, (cluster, hosts),
                      evaluation)
    except (KeyboardInterrupt, Interrupted) as err:  # before training started: nothing to keep
        if claimed:
            _unclaim(cfg, run_dir)
        print(f"interrupted during start-up ({err or 'SIGINT'}); nothing was written", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except ConfigError:
        if claimed:
            _unclaim(cfg, run_dir)
        raise
    finally:
        if cluster is not None:
            cluster.close()  # a cluster started here is shut down; a joined one is left as it was
        if claim is not None:
            claim.release()  # the flock held since the claim: the directory is free once everything is written
        if umask is not None:
            os.umask(umask)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _unclaim(cfg: DictConfig, run_dir: Path) -> None:
    """Give back a directory claimed by a run that stopped before writing anything (a rerun may use it)."""
    if not cfg.resume and not any((run_dir / name).exists() for name in ("checkpoint.pt", "metrics.jsonl")):
        (run_dir / LOCK).unlink(missing_ok=True)
        (run_dir / DiskReserve.NAME).unlink(missing_ok=True)
        shutil.rmtree(run_dir / ".hydra", ignore_errors=True)


@dataclass(frozen=True)
class JobInfo:
    """Where a run sits in a sweep: its overrides and the sweep's group (None for a single run)."""

    overrides: list[str]
    sweep_group: str | None = None


def _train(cfg: DictConfig, run_dir: Path, plan: Plan, env_factory: Any, env_spec: Any, hook: Any,
           resume: bool, previous: dict[int, Any], job: JobInfo, ray_hosts: tuple[Any, Any] = (None, None),
           evaluation: EvalSetup | None = None) -> int:
    report_pools("driver")  # pinned in run(), before the probes
    apply_determinism(plan.deterministic)
    torch.manual_seed(int(cfg.seed))
    np.random.seed(int(cfg.seed))
    model_spec, trainer = build_learner(cfg, env_spec, plan)
    raise_if_pending()
    algo = trainer.config
    restored = load_run_state(run_dir / "checkpoint.pt") if resume else None
    start_frames = 0
    if restored is not None:
        start_frames = int(restored["frames"])
        if start_frames >= algo.total_frames:
            raise ConfigError(f"resume={str(run_dir)!r}: the run already has {start_frames} frames and "
                              f"trainer.total_frames={algo.total_frames}; give a larger trainer.total_frames")
        trainer.load_state_dict(restored)
        set_rng_state(restored["rng"])
    buffer, nstep = build_replay(cfg, run_dir, plan, algo, env_spec)
    reserve = DiskReserve(run_dir, final_write_bytes(trainer, cfg))
    if restored is not None and buffer is not None and restored.get("replay") is not None:
        buffer.load_state_dict(restored["replay"])
        nstep.load_state_dict(restored["nstep"])
        close_open_windows(nstep, buffer)  # their envs are gone: the resumed run builds new ones
    if resume:
        rewind_metrics(run_dir / "metrics.jsonl", start_frames)
    cluster, hosts = ray_hosts
    on_start = None
    if hosts is not None:
        from pipeline.plan.ray import placement_lines

        def placed(where: list[dict[str, Any]]) -> None:
            print("\n".join(["ray hosts:", *placement_lines(where, cluster.nodes())]), flush=True)

        on_start = placed

    def make_collector(frames: int) -> Any:
        # Resumed (or at a restart point): fresh env seeds, replaying the first episodes again would bias the data.
        return build_collector(cfg, plan, env_factory, env_spec, model_spec, seed=env_seed_at(int(cfg.seed), frames),
                               total_frames=algo.total_frames, initial_frames=frames,
                               policy_version=trainer.policy_version, replay_buffer=buffer, postproc=nstep,
                               post_collect_hook=hook, skip_non_finite=algo.nan_policy == "skip",
                               ray_hosts=ray_hosts, on_start=on_start, frames_per_batch=algo.frames_per_batch)

    collector = make_collector(start_frames)
    # the trainer's version (0 for a new run): these weights are served from the first request
    collector.update_policy_weights_(trainer.model, version=trainer.policy_version)
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # plain words: weights_only loads it
    assert isinstance(resolved, dict)
    logger = instantiate(cfg.logger, run_dir=run_dir, name=run_dir.name, run_config=resolved,
                         resume_id=restored.get("wandb_id") if restored else None, overrides=job.overrides,
                         group=cfg.logger.group or job.sweep_group,
                         job_type=cfg.logger.job_type or ("sweep" if job.sweep_group else "train"),
                         _convert_="all", _recursive_=False)
    assert isinstance(logger, MetricsLogger)
    reporter = Reporter(collector, logger, total_frames=algo.total_frames, window=algo.target_window,
                        target_return=algo.target_return, progress=bool(cfg.progress), replay=buffer,
                        start_frames=start_frames, elapsed=float(restored.get("elapsed_s", 0.0)) if restored else 0.0,
                        tasks=task_episodes(env_factory, algo.target_window), deterministic=plan.deterministic)
    if restored is not None:
        restore_episodes(reporter.tracker, restored["episodes"])
    replay_saved = ReplayInCheckpoints(buffer, cfg, plan.deterministic)

    def state(stop_reason: str) -> dict[str, Any]:
        saved_replay = buffer if replay_saved() else None
        out = run_state(trainer=trainer, frames=reporter.collector.frames, config=resolved, model_spec=model_spec,
                        env_spec=env_spec, tracker=reporter.tracker, stop_reason=stop_reason,
                        wandb_id=logger.wandb_id, replay=saved_replay, nstep=nstep)
        out["elapsed_s"] = reporter.elapsed
        return out

    checkpoint_path = run_dir / "checkpoint.pt"
    interval = None if plan.deterministic or cfg.checkpoint.interval is None else float(cfg.checkpoint.interval)
    every = OmegaConf.select(cfg, "checkpoint.frames", default=None)
    if cfg.checkpoint.enabled and (interval is not None or every):
        # a saved replay must match the n-step windows beside it (a disk one, its files): the writer pauses
        reporter.checkpointer = Checkpointer(checkpoint_path, interval, lambda: state("checkpoint"),
                                             pause=(lambda: reporter.collector.pause()) if buffer is not None else None,
                                             every_frames=int(every) if every else None, start_frames=start_frames)
    if plan.deterministic:  # restart points at its checkpoints, RNGs re-seeded as a resumed run's
        reporter.make_restart = lambda old: restart_collector(old, make_collector, trainer, nstep, buffer)
        reporter.reseed = lambda frames: reseed(int(cfg.seed), frames)
    reporter.evaluator = build_evaluator(evaluation, env_factory, model_spec, env_spec, int(cfg.seed), run_dir)
    if reporter.evaluator is not None:
        reporter.eval_interval = evaluation.settings.interval
        reporter.snapshot = lambda: (trainer.model.state_dict(), trainer.policy_version)
    reporter.target_metric = str(algo.target_metric)
    stop_reason, code, keep_last_good = "total_frames", EXIT_OK, False
    try:
        if trainer.on_policy:
            stop_reason = run_on_policy(collector, trainer, reporter)
        else:
            stop_reason = run_off_policy(collector, trainer, buffer, reporter)
        reporter.final_evaluation()  # the final weights, greedily, on the eval envs
    except (KeyboardInterrupt, Interrupted, SystemError) as err:  # SystemError: a signal a C extension wrapped
        stop_reason, code = f"interrupted ({interrupt_of(err) or 'SIGINT'})", EXIT_INTERRUPTED
    except (CollectorError, EvaluationError) as err:
        stop_reason, code = f"failed: {err}", EXIT_FAILED
    except NonFiniteError as err:
        stop_reason, code, keep_last_good = f"failed: {err}", EXIT_FAILED, True
    except OSError as err:  # a write to the run directory failed (a full disk): end cleanly, say so
        stop_reason, code = f"failed: cannot write to the run directory: {err}", EXIT_FAILED
        reserve.release()  # room for the last row, the summary and the checkpoint
    finally:
        # The clean-up, in this order: stop the collector, the checkpoint, the summary row, then the sinks.
        # Each step is bounded in time and a failure in one (any exception) is one line that does not skip
        # the next. No second Ctrl-C may cut it short before the checkpoint and the summary are written
        # (nothing before them waits for a sink: rows are queued, never sent in line); during the sinks'
        # close, the last step, a second Ctrl-C abandons them at once.
        try:
            ignore_signals(previous)
        except (KeyboardInterrupt, Interrupted) as err:  # a second one in the moment before: ignored from now
            ignore_signals(previous)
            if code == EXIT_OK:
                stop_reason, code = f"interrupted ({err or 'SIGINT'})", EXIT_INTERRUPTED
        tracker, collector = reporter.tracker, reporter.collector  # the collector of the last restart point
        checkpoint = None
        lost: list[str] = []  # final writes that failed even so
        with _best_effort(lost, "close the progress display"):
            reporter.close()
        with _best_effort(lost, "stop the collector"):
            collector.shutdown()
        if reporter.evaluator is not None:
            with _best_effort(lost, "stop the evaluator"):
                reporter.evaluator.close()
        reserve.release()
        if reporter.pending or reporter.last_frames != collector.frames:
            with _best_effort(lost, "write the last metrics row"):
                reporter.flush(echo=False)  # the last row describes the final state
        if cfg.checkpoint.enabled and not keep_last_good:
            with _best_effort(lost, "write the final checkpoint"):
                checkpoint = save_run_state(checkpoint_path, state(stop_reason))
        with _best_effort(lost, "write the summary"):
            logger.summary(summary_row(collector, reporter, stop_reason, deterministic=plan.deterministic,
                                       resolved=resolved))
        interrupted: list[str] = []
        with _best_effort(lost, "close the logger", interrupted), signals_raise(previous):
            logger.close(exit_code=code)  # its sinks: bounded by logger.wandb_timeout, then abandoned
        if interrupted and code == EXIT_OK:  # the sinks were abandoned; what the run wrote is complete
            code = EXIT_INTERRUPTED
        elif lost and code == EXIT_OK:
            stop_reason, code = f"failed: could not {lost[0]}", EXIT_FAILED
        if cluster is not None:  # before the last lines: Ray forwards its daemons' logs until disconnected
            with _best_effort(lost, "disconnect from the Ray cluster"):
                cluster.close()
    returns = (f"mean return {tracker.mean_return:.1f} over the last {len(tracker.returns)} episodes"
               if len(tracker.returns) else "no episode ended yet")  # a short budget on long episodes
    print(f"{stop_reason}: {collector.frames} frames in {reporter.elapsed:.1f} s, {returns}"
          + (f"; checkpoint {checkpoint}" if checkpoint else ""), flush=True)
    if code == EXIT_FAILED:
        print(f"error: {stop_reason.removeprefix('failed: ')}", file=sys.stderr, flush=True)
    return code


@contextlib.contextmanager
def _best_effort(lost: list[str], what: str, interrupted: list[str] | None = None) -> Iterator[None]:
    """Run one step of the clean-up; any exception is noted in ``lost`` and one line on stderr, never raised.

    Whatever goes wrong in one final write (a full disk, a bug, a library's
    own exception) must not skip the next: the checkpoint, the summary row
    and the logger's close each get their turn. With ``interrupted``, a
    Ctrl-C or SIGTERM (the step ran with signals raising) is noted there too.
    """
    try:
        yield
    except (KeyboardInterrupt, Interrupted) as err:
        if interrupted is None:
            raise
        interrupted.append(str(err) or "SIGINT")
        lost.append(f"{what} (interrupted)")
        print(f"warning: could not {what}: interrupted ({err or 'SIGINT'}); it was abandoned", file=sys.stderr,
              flush=True)
    except Exception as err:  # noqa: BLE001 - see the docstring
        text = str(err) if isinstance(err, OSError) else _first_line(err)
        lost.append(f"{what} ({text})")
        print(f"warning: could not {what}: {text}", file=sys.stderr, flush=True)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def concurrent_jobs(hydra_cfg: Any, cpus: int) -> int:
    """How many jobs of this multirun share the machine at once (1: one after another, or one per node)."""
    launcher = hydra_cfg.get("launcher", {}) or {}
    target = str(launcher.get("_target_", ""))
    if "joblib" in target.lower():
        n_jobs = launcher.get("n_jobs")
        if n_jobs is None or int(n_jobs) == 0:
            return 1
        n = int(n_jobs)
        return max(1, cpus + 1 + n if n < 0 else n)  # joblib: -1 = all CPUs, -2 = all but one
    if "LocalLauncher" in target:  # submitit_local: every job of the array at once, up to array_parallelism
        return max(1, min(int(launcher.get("array_parallelism") or 1), cpus))
    return 1


def main_from_hydra(cfg: DictConfig) -> float | None:
    """The Hydra task: one-line errors and exit codes, no tracebacks for user mistakes.

    A single run exits with its code. A job of a multirun never exits the
    process (a failed point must not stop the sweep): it records its outcome
    for the sweep's summary (:mod:`pipeline.runner.sweep`), prints one status line
    and returns ``sweep.objective`` (NaN when it failed: a failed optuna
    trial); only Ctrl-C stops the sweep.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from pipeline.runner import sweep

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    record = None
    concurrent = 1
    if multirun:
        sweep_dir = Path(hydra_cfg.sweep.dir)
        record = sweep.started(sweep_dir, int(hydra_cfg.job.num), overrides, run_dir)
        concurrent = concurrent_jobs(hydra_cfg, Machine.detect().cpus)
    error = None
    choices, rechosen = dict(hydra_cfg.runtime.choices), None
    family = family_config(cfg, overrides, choices)
    if family is not None:  # env=gym with a Box2D, MuJoCo, Atari... id: run as its family's option would
        from hydra import compose

        rechosen, cfg = family[0], compose(config_name="config", overrides=family[1])
        choices.update(env=rechosen, specialize=f"{choices.get('trainer')}_{rechosen}")
    try:
        code = run(cfg, run_dir, (cfg, OmegaConf.create({"hydra": hydra_cfg}), overrides),
                   sweep_group=Path(hydra_cfg.sweep.dir).name if multirun else None, concurrent_jobs=concurrent,
                   preset=preset_line(cfg, overrides, choices, rechosen=rechosen))
    except ConfigError as err:
        error = f"config error: {err}"
        print(error, file=sys.stderr, flush=True)
        code = EXIT_CONFIG
    if record is None:
        if code == EXIT_INTERRUPTED:
            exit_interrupted(code)
        if code != EXIT_OK:
            sys.exit(code)
        return None
    objective = str(cfg.sweep.objective)
    record = sweep.ended(sweep_dir, record, code, objective, error)
    print(sweep.status_line(record, objective), flush=True)
    if code == EXIT_INTERRUPTED:
        exit_interrupted(code)  # Ctrl-C stops the whole sweep
    return record.objective if record.ok and record.objective is not None else float("nan")
