"""Resolve the config's ``auto`` choices into a printable plan of the collector graph.

:func:`resolve_plan` is a pure function of the config and a :class:`Machine`
description, so every choice (and its reason) is testable without starting
anything. ``auto`` never decides silently: each resolved choice carries the
sentence the runner prints.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from components.collector.graph import GraphSpec
from components.inference.loop import ServerConfig
import pipeline.plan.rules as rules
from pipeline.validate import ConfigError


@dataclass(frozen=True)
class Machine:
    """What the plan may depend on besides the config."""

    cpus: int
    cuda: bool
    cuda_count: int = 0
    #: why ``cpus`` is less than the machine has (a share of a parallel sweep), for the plan
    note: str | None = None

    @classmethod
    def detect(cls) -> Machine:
        import torch

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        cuda = torch.cuda.is_available()
        return cls(cpus=cpus, cuda=cuda, cuda_count=torch.cuda.device_count() if cuda else 0)


@dataclass(frozen=True)
class Plan:
    """The resolved collector graph and where the trainer runs, with reasons."""

    graph: GraphSpec
    server: ServerConfig
    trainer_device: str
    storing_device: str = "cpu"
    frame_dedup: bool | None = None
    reasons: tuple[tuple[str, str], ...] = field(default=())
    #: the first line of the printed plan when the envs are not in local workers (workers=ray)
    envs_line: str | None = None
    #: transport=auto with measured costs: the chosen :class:`~pipeline.layout.Layout` and its prediction
    layout: Any = None

    def reason(self, key: str) -> str:
        return dict(self.reasons).get(key, "")

    def lines(self) -> list[str]:
        g = self.graph
        out = [self.envs_line or
               f"envs      {g.num_envs} in {g.num_workers} {g.workers} worker(s) of up to {g.envs_per_worker}"]
        out += [f"{key:<9} {text}" for key, text in self.reasons]
        return out

    def __str__(self) -> str:
        return "\n".join(["plan:", *("  " + line for line in self.lines())])


def thread_budget_text(cfg: DictConfig, graph: GraphSpec) -> str:
    """The plan's ``threads`` line: what each kind of process's BLAS/OpenMP/torch pools hold."""
    parts = [f"driver {int(cfg.torch_threads)} (torch_threads: trainer"
             + (", thread workers" if graph.workers == "thread" else "")
             + (", inference thread" if graph.server == "thread" else "")
             + (", inline policy" if graph.server == "inline" and graph.workers == "thread" else "") + ")"]
    if graph.workers == "process":
        parts.append(f"{graph.num_workers} env worker process(es) {graph.worker_threads} each"
                     + (" (server.num_threads: each runs its policy copy)" if graph.server == "inline" else ""))
    if graph.server == "process":
        parts.append(f"inference process {int(cfg.server.num_threads)} (server.num_threads)")
    parts.append("metric sinks 1")
    return ", ".join(parts) + "; pinned in each process before numpy or torch loads"


def serving_engine(cfg: DictConfig, policy_device: str) -> tuple[str, str]:
    """:func:`rules.serving_engine` for ``cfg``."""
    return rules.serving_engine(str(cfg.server.engine), str(cfg.model._target_), str(cfg.model.encoder), policy_device)


def _frame_dedup(cfg: DictConfig, env_spec: Any) -> tuple[bool | None, str]:
    """``replay.frame_dedup`` resolved against the env's observations (None: not known yet)."""
    value = str(cfg.replay.frame_dedup).lower()
    if env_spec is None:
        return (None, "auto (decided from the env's observations)") if value == "auto" else (value == "true", value)
    stacks = env_spec.obs_dtype == "uint8" and len(env_spec.obs_shape) == 3
    shape = "x".join(str(d) for d in env_spec.obs_shape)
    if value != "auto":
        if value == "true" and not stacks:
            raise ConfigError(f"replay.frame_dedup={cfg.replay.frame_dedup}: observations {shape} "
                              f"{env_spec.obs_dtype} are not uint8 frame stacks (use auto or false)")
        return value == "true", value
    if stacks:
        return True, f"auto -> on: {shape} uint8 frame stacks, each frame stored once"
    return False, f"auto -> off: {shape} {env_spec.obs_dtype} observations are not uint8 frame stacks"


#: An env whose step waits this many times longer than it computes is "mostly waiting": thread
#: workers would step such envs one after another, so ``transport=auto`` moves them to processes.
WAITING_RATIO = 4.0


def _measured_layout(cfg: DictConfig, costs: Any, num_envs: int, workers: str, policy_device: str,
                     shareable: bool) -> Any:
    """``transport=auto`` with measured costs: the best predicted layout this config allows."""
    from pipeline.layout import choose

    if policy_device != "cpu":  # an accelerator: batching on it is the point of a central server
        servers: tuple[str, ...] = ("process", "thread") if shareable else ("thread",)
    else:
        servers = ("inline", "thread", "process")
    backend: str | None = None if workers == "auto" else workers
    if workers == "thread" and costs.env_wait_s > WAITING_RATIO * costs.env_cpu_s:
        backend = None  # mostly-waiting envs: thread workers would make each env wait for the others
    requested = cfg.env.envs_per_worker
    concurrent = str(cfg.workers.concurrent_envs).lower()
    best, _ = choose(costs, num_envs, workers=backend, servers=servers,
                     envs_per_worker=None if requested is None else min(int(requested), num_envs),
                     shareable=shareable, concurrent=None if concurrent == "auto" else concurrent == "true")
    return best


def _measured_reason(chosen: Any, costs: Any, num_envs: int) -> str:
    from pipeline.layout import machine_limit

    limit = machine_limit(costs, num_envs)
    # concurrent envs: the policy sees the envs that returned together, not the whole worker
    rows = chosen.detail.get("batch", chosen.envs_per_worker)
    return (f"auto (measured) -> {chosen.describe(num_envs)}: predicted {chosen.predicted_fps:,.0f} frames/s "
            f"({chosen.bound}-bound; limit {limit:,.0f}); env step {costs.env_wall_s * 1e6:,.1f} us wall / "
            f"{costs.env_cpu_s * 1e6:,.1f} us CPU, policy {costs.infer_at(rows) * 1e6:.2f} "
            f"us/sample at {rows:.3g} row{'' if rows == 1 else 's'} ({costs.engine}), wake-up {costs.hop_s * 1e6:.1f} us"
            + (f", trainer {costs.trainer_s * 1e6:,.1f} us/frame" if costs.trainer_s else ""))


def resolve_plan(cfg: DictConfig, machine: Machine, env_spec: Any = None, costs: Any = None) -> Plan:
    """Turn ``cfg`` (already validated) into a :class:`Plan` for ``machine``.

    ``env_spec`` (the probed env's spec, optional) lets ``auto`` choices that
    depend on the observations (frame dedup) be made here, in the printed plan.
    ``costs`` (a :class:`pipeline.layout.Costs` probe, optional) lets
    ``transport=auto`` choose the layout by predicted frames/s; without it
    the rule of earlier versions applies (process workers -> a server
    process). Raises :class:`ConfigError` for a graph that could never make
    progress.
    """
    workers = str(cfg.workers.backend)
    transport = str(cfg.transport.kind)
    server = str(cfg.server.backend)
    if workers == "ray":  # each env host is a thread worker with an inline policy copy (pipeline/plan/ray.py)
        workers, server = "thread", "inline"
    if workers == "auto" and (costs is None or transport != "auto" or server == "inline"):
        workers = "thread"  # nothing measured to choose by: the instant start
    num_envs = int(cfg.env.num_envs)
    frames_per_batch = int(cfg.trainer.frames_per_batch)
    reasons: list[tuple[str, str]] = []
    if machine.note:
        reasons.append(("cpus", machine.note))

    policy_device, policy_note = rules.device(str(cfg.device.policy_device), machine.cuda)
    trainer_device, trainer_note = rules.device(str(cfg.device.trainer_device), machine.cuda)
    storing_device, _ = rules.device(str(cfg.device.storing_device), machine.cuda)

    shareable = policy_device == "cpu" or policy_device.startswith("cuda")
    splits = int(cfg.workers.splits)
    # Without a measurement, envs step concurrently only when asked to.
    concurrent = str(cfg.workers.concurrent_envs).lower() == "true"
    measured: tuple[Any, str] | None = None
    splits_note: str | None = None
    if server == "inline":
        if policy_device != "cpu":
            policy_note = f"server=inline -> cpu: each worker runs its copy of the policy on its CPU ({policy_note})"
            policy_device = "cpu"
        reasons.append(("transport", "none: server=inline evaluates the policy inside each env worker, no "
                                     "request ever leaves the worker"))
        splits_note = "; 1 block per worker (inline answers within the call: nothing to overlap)" \
            if splits != 1 else ""
        splits = 1
    elif transport == "auto" and costs is not None:
        chosen = _measured_layout(cfg, costs, num_envs, workers, policy_device, shareable)
        workers, server, splits, concurrent = chosen.workers, chosen.server, chosen.splits, chosen.concurrent
        measured = (chosen, f"{chosen.envs_per_worker} envs per worker (measured)")
        transport = "none" if server == "inline" else "slots"
        reasons.append(("transport", _measured_reason(chosen, costs, num_envs)))
    elif transport == "auto":
        transport, why = "slots", "auto -> slots: every worker reaches the server's shared-memory slots directly"
        if workers == "process" and server != "process":
            if shareable:
                why += "; server=thread -> process (env workers are processes; transport=slots server=thread " \
                       "keeps it in the driver)"
                server = "process"
            else:
                why += f"; server stays a driver thread: policy_device={policy_device} cannot be shared with a process"
        reasons.append(("transport", why))
    else:
        reasons.append(("transport", "slots: every worker reaches the server's shared-memory slots directly"))

    blocks_text = f"{splits} block(s) per worker"
    if concurrent:
        blocks_text = "each env in its own thread, served as it returns (none waits for another's step)"
        if splits != 1:
            blocks_text += f"; workers.splits={splits} -> 1 (no blocks to alternate)"
            splits = 1
    if measured is not None:
        per_worker = measured[0].envs_per_worker
        count = math.ceil(num_envs / per_worker)
        reasons.insert(0, ("workers", f"auto (measured) -> {count} {workers} worker(s) of up to {per_worker} envs, "
                                      + blocks_text))
    else:
        per_worker, why = rules.envs_per_worker(cfg.env.envs_per_worker, num_envs, workers, machine.cpus, server)
        if server == "inline" and not concurrent:
            reasons.insert(0, ("workers", f"{why}{splits_note or '; ' + blocks_text}"))
        else:
            reasons.insert(0, ("workers", f"{why}; {blocks_text}"))
    where = {"process": "a dedicated process", "thread": "a driver thread",
             "inline": f"each of the {math.ceil(num_envs / per_worker)} env worker(s) (its own copy)"}[server]
    device_text = policy_device if policy_note == policy_device else f"{policy_device} ({policy_note})"
    split = ""
    if cfg.server.max_batch_size < min(per_worker, num_envs):
        passes = math.ceil(min(per_worker, num_envs) / cfg.server.max_batch_size)
        split = f"; a {per_worker}-env block exceeds max_batch_size, so it is served in {passes} passes"
    engine, engine_why = serving_engine(cfg, policy_device)
    batching = (f"one forward per block of up to {min(per_worker, cfg.server.max_batch_size)} rows{split}"
                if server == "inline" else
                f"batches of {cfg.server.min_batch_size}..{cfg.server.max_batch_size} rows{split}")
    reasons.append(("server", f"{server}: policy on {device_text} in {where}, {batching}; engine {engine_why}"))

    mode = str(cfg.chunking.mode)
    if mode == "fixed":
        chunk_len, why = int(cfg.chunking.size), f"fixed: {cfg.chunking.size} steps per message"
    elif mode == "step":
        chunk_len, why = 1, "step: every step is a message"
    elif workers == "process":
        chunk_len, why = rules.chunk_len(num_envs, frames_per_batch, per_worker)
    else:
        chunk_len, why = 1, "auto -> 1 step per message: thread workers have no process boundary to amortise"
    reasons.append(("chunking", why))
    reasons.append(("device", f"policy {policy_device}, trainer {trainer_device}, batches stored on {storing_device}"
                    + (f" ({trainer_note})" if trainer_note != trainer_device else "")))
    dedup: bool | None = None
    if cfg.replay.kind != "none":
        where = "memory" if cfg.replay.storage == "memory" else "memory-mapped files in the run directory"
        dedup, dedup_why = _frame_dedup(cfg, env_spec)
        reasons.append(("replay", f"{cfg.replay.kind}, {cfg.replay.capacity} transitions in {where}, "
                        f"frame dedup {dedup_why}, written by a background writer thread"))
    target = cfg.trainer.target_return
    reasons.append((
        "trainer",
        f"{cfg.trainer.name}: {frames_per_batch} frames per batch, stop at {cfg.trainer.total_frames} frames"
        + (f" or a mean return >= {target} over {cfg.trainer.target_window} episodes" if target is not None else ""),
    ))

    graph = GraphSpec(
        workers=workers,
        server=server,
        num_envs=num_envs,
        envs_per_worker=per_worker,
        chunk_len=chunk_len,
        splits=splits,
        chunks_per_worker=cfg.chunking.chunks_per_worker,
        worker_affinity=tuple(tuple(int(c) for c in a) for a in cfg.workers.affinity) if cfg.workers.affinity else None,
        worker_nice=int(cfg.workers.nice) if workers == "process" else 0,
        concurrent_envs=concurrent,
        worker_threads=rules.worker_threads(server, int(cfg.server.num_threads)),
    )
    problem = graph.chunk_budget_problem(frames_per_batch)
    if problem is not None:
        raise ConfigError(f"chunking.chunks_per_worker={cfg.chunking.chunks_per_worker}: {problem}")
    c = cfg.collector
    extras = [f"stall timeout {c.stall_timeout:g} s" if c.stall_timeout is not None else "no stall timeout"]
    extras += [text for flag, text in ((c.yield_completed_trajectories, "yields completed trajectories"),
                                       (c.reset_at_each_iter, "resets every env after each batch"),
                                       (c.post_collect_hook, f"hook {c.post_collect_hook}"),
                                       (c.driver_affinity, f"driver threads on CPUs {list(c.driver_affinity or [])}"),
                                       (c.policy_version, f"initial policy version {c.policy_version}")) if flag]
    reasons.append(("collector", ", ".join(extras)))
    reasons.append(("threads", thread_budget_text(cfg, graph)))
    server_cfg = ServerConfig(
        max_batch_size=int(cfg.server.max_batch_size),
        min_batch_size=int(cfg.server.min_batch_size),
        timeout=float(cfg.server.timeout),
        stats_reservoir=int(cfg.server.stats_reservoir),
        device=policy_device,
        num_threads=int(cfg.server.num_threads),
        seed=int(cfg.seed),
        engine=engine,
        static_batch_size=cfg.server.static_batch_size if policy_device.startswith("cuda") else None,
    )
    return Plan(graph=graph, server=server_cfg, trainer_device=trainer_device, storing_device=storing_device,
                frame_dedup=dedup, reasons=tuple(reasons), layout=measured[0] if measured is not None else None)
