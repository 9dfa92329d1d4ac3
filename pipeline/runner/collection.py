"""One way from a plan to a running collector: the runner's and the benchmark's.

A plan's graph becomes an :class:`~components.collector.collector.AsyncBatchedCollector`,
or, with Ray hosts, a :class:`~components.ray.collector.RayCollector`, with
the fault settings of the config (restarts, timeouts, the stall watchdog).
What only a training run has (replay, the n-step post-processor, the trainer's
policy version, resumed frames) comes in as keywords, so the benchmark
measures the collector the same command trains with, minus the learner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from components.collector.protocol import Collector
from components.models import ModelSpec
from pipeline.plan.resolve import Plan


def build_collector(cfg: DictConfig, plan: Plan, env_factory: Any, env_spec: Any, model_spec: ModelSpec, *,
                    seed: int, total_frames: int, initial_frames: int = 0, policy_version: int = 0,
                    replay_buffer: Any = None, postproc: Any = None, post_collect_hook: Any = None,
                    skip_non_finite: bool = False, ray_hosts: tuple[Any, Any] = (None, None),
                    on_start: Callable[[list[dict[str, Any]]], None] | None = None,
                    frames_per_batch: int | None = None) -> Collector:
    """The collector ``plan`` describes (``ray_hosts``: the cluster and hosts' spec of ``workers=ray``)."""
    c = cfg.collector
    common: dict[str, Any] = dict(
        frames_per_batch=int(cfg.trainer.frames_per_batch if frames_per_batch is None else frames_per_batch),
        total_frames=total_frames, initial_frames=initial_frames,
        seed=seed, server_config=plan.server, env_spec=env_spec,
        replay_buffer=replay_buffer, postproc=postproc, storing_device=plan.storing_device,
        policy_version=policy_version, stall_timeout=c.stall_timeout,
        step_timeout=cfg.workers.step_timeout,
        # a relaunched worker's envs start afresh, which a deterministic run could not replay
        max_restarts=0 if plan.deterministic else int(cfg.workers.max_restarts),
        restart_window=float(cfg.workers.restart_window), skip_non_finite=skip_non_finite,
        yield_completed_trajectories=bool(c.yield_completed_trajectories), post_collect_hook=post_collect_hook,
        driver_affinity=list(c.driver_affinity) if c.driver_affinity else None,
    )
    cluster, hosts = ray_hosts
    if hosts is not None:
        from components.ray.collector import RayCollector

        return RayCollector(env_factory, model_spec, hosts, cluster, **common, on_start=on_start)
    from components.collector.collector import AsyncBatchedCollector
    from pipeline.plan.trainer_spec import dense_successors

    return AsyncBatchedCollector(env_factory, model_spec, plan.graph, **common,
                                 server_restarts=int(cfg.server.max_restarts),
                                 server_step_timeout=cfg.server.step_timeout,
                                 reset_at_each_iter=bool(c.reset_at_each_iter), lockstep=plan.deterministic,
                                 dense_successors=dense_successors(cfg, env_spec))
