"""Resolve the config's ``auto`` choices into a :class:`Plan` of the collector graph.

:func:`resolve_plan` is a pure function of the config and a :class:`Machine`
description, so every choice (and its reason) is testable without starting
anything. It only decides: each line of the plan is a
:class:`~pipeline.plan.choice.Choice` (value, rule code, facts), and
:mod:`pipeline.plan.render` writes the sentences the runner prints.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from components.collector.graph import GraphSpec
from components.collector.lockstep import lockstep_chunk_len, lockstep_problem
from components.inference.loop import ServerConfig
from components.obs_tree import frame_leaves
from components.replay.key_names import names_a_file
import pipeline.plan.render as render
import pipeline.plan.rules as rules
from pipeline.plan.eval_settings import eval_settings
from pipeline.plan.trainer_spec import dense_successors
from pipeline.plan.choice import Choice
from pipeline.plan.validate import ConfigError


@dataclass(frozen=True)
class Machine:
    """What the plan may depend on besides the config."""

    cpus: int
    cuda: bool
    cuda_count: int = 0
    #: the machine's CPUs when ``cpus`` is a share of them (a parallel sweep), else None
    total_cpus: int | None = None
    #: how many sweep jobs share the machine (hydra.launcher.n_jobs) when ``total_cpus`` is set
    sweep_jobs: int = 1

    @classmethod
    def detect(cls) -> Machine:
        import torch

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        cuda = torch.cuda.is_available()
        return cls(cpus=cpus, cuda=cuda, cuda_count=torch.cuda.device_count() if cuda else 0)


@dataclass(frozen=True)
class Plan:
    """The resolved collector graph and where the trainer runs, with the choices that made them."""

    graph: GraphSpec
    server: ServerConfig
    trainer_device: str
    storing_device: str = "cpu"
    frame_dedup: bool | None = None
    #: the plan's lines in print order: (key, the choice that line explains)
    choices: tuple[tuple[str, Choice], ...] = field(default=())
    #: the plan's first line: where the envs are (local workers, or Ray hosts)
    envs: Choice | None = None
    #: transport=auto with measured costs: the chosen :class:`~pipeline.plan.layout.Layout` and its prediction
    layout: Any = None
    #: deterministic=true: lockstep collection (components.collector.lockstep) and a reproducible run
    deterministic: bool = False

    def choice(self, key: str) -> Choice:
        """The choice behind the plan's ``key`` line (KeyError: the plan has no such line)."""
        return dict(self.choices)[key]

    def with_choice(self, key: str, choice: Choice) -> Plan:
        """This plan with ``key``'s line replaced (or appended)."""
        from dataclasses import replace

        keys = [k for k, _ in self.choices]
        if key in keys:
            return replace(self, choices=tuple((k, choice if k == key else c) for k, c in self.choices))
        return replace(self, choices=(*self.choices, (key, choice)))

    def reason(self, key: str) -> str:
        """The sentence the plan prints for ``key`` ("" when it has no such line)."""
        choice = dict(self.choices).get(key)
        return "" if choice is None else render.line(key, choice)

    def lines(self) -> list[str]:
        return render.plan_lines(self)

    def __str__(self) -> str:
        return "\n".join(["plan:", *("  " + line for line in self.lines())])


def serving_engine(cfg: DictConfig, policy_device: str, env_spec: Any = None) -> Choice[str]:
    """:func:`rules.serving_engine` for ``cfg`` (and the env's spaces, when known)."""
    target = str(cfg.model._target_)
    if recurrent_core(cfg) is not None and target in rules.NUMPY_MODELS:
        target = rules.RECURRENT_MODEL
    return rules.serving_engine(str(cfg.server.engine), target, str(cfg.model.encoder), policy_device,
                                rules.numpy_spaces(env_spec))


def recurrent_core(cfg: DictConfig) -> str | None:
    """``model.rnn`` (lstm, gru) or None: a feed-forward model."""
    rnn = OmegaConf.select(cfg, "model.rnn", default=None)
    return None if rnn is None else str(rnn)


def _recurrent(cfg: DictConfig, per_worker: int, chunk_len: int, env_spec: Any) -> Choice[str]:
    """The plan line of a recurrent core: its state per env, and what that adds to slots and chunks."""
    kind = str(recurrent_core(cfg))
    hidden, layers = int(cfg.model.rnn_hidden), int(cfg.model.rnn_layers)
    # components.recurrent: one trunk shared by both heads over image frames, an actor's and a critic's otherwise
    shared = str(cfg.model.encoder) == "nature_cnn" and not getattr(env_spec, "is_tree", False)
    trunks = 1 if shared else 2
    state_bytes = trunks * (2 if kind == "lstm" else 1) * layers * hidden * 4
    return Choice(kind, "recurrent", {
        "hidden": hidden, "layers": layers, "state_bytes": state_bytes, "trunks": trunks,
        # request: the state and is_first; response: the next state; chunk row: both states and is_first
        "slot_bytes": per_worker * (2 * state_bytes + 1), "row_bytes": 2 * state_bytes + 1,
        "chunk_bytes": per_worker * chunk_len * (2 * state_bytes + 1),
        "seq_len": OmegaConf.select(cfg, "trainer.seq_len", default=None)})


def _check_disk_leaf_names(cfg: DictConfig, env_spec: Any) -> None:
    """A disk replay stores each leaf of a Dict observation in a file named by its keys: refuse keys that
    cannot be one (a ``/``, a space), here in one line rather than in the replay writer."""
    if env_spec is None or not env_spec.is_tree or str(cfg.replay.storage) != "disk":
        return
    for leaf in env_spec.obs_leaves:
        bad = next((part for part in leaf.key if not names_a_file(part)), None)
        if bad is not None:
            raise ConfigError(f"replay.storage=disk: the observation's Dict key {bad!r} cannot name a file "
                              "(letters, digits, _, . and - only); use replay.storage=memory or rename the key")


def _frame_dedup(cfg: DictConfig, env_spec: Any) -> Choice[bool | None]:
    """``replay.frame_dedup`` resolved against the env's observations (None: not known yet)."""
    value = str(cfg.replay.frame_dedup).lower()
    if env_spec is None:
        return Choice(None, "auto.pending") if value == "auto" else Choice(value == "true", "given", {"word": value})
    if env_spec.is_tree:  # a Dict/Tuple: its image leaves, if it has any
        images = frame_leaves(env_spec.obs_leaves)
        stacks = bool(images)
        facts = {"shape": "x".join(str(d) for d in images[0].shape) if images else "",
                 "dtype": "uint8", "leaves": [leaf.name for leaf in images]}
        what = "the Dict/Tuple observation has no uint8 [stack, H, W] image leaf of at least 36x36"
    else:
        stacks = env_spec.obs_dtype == "uint8" and len(env_spec.obs_shape) == 3
        facts = {"shape": "x".join(str(d) for d in env_spec.obs_shape), "dtype": str(env_spec.obs_dtype)}
        what = f"observations {facts['shape']} {env_spec.obs_dtype} are not uint8 frame stacks"
    if value != "auto":
        if value == "true" and not stacks:
            raise ConfigError(f"replay.frame_dedup={cfg.replay.frame_dedup}: {what} (use auto or false)")
        return Choice(value == "true", "given", {"word": value})
    return Choice(True, "auto.on", facts) if stacks else Choice(False, "auto.off", facts)


#: An env whose step waits this many times longer than it computes is "mostly waiting": thread
#: workers would step such envs one after another, so ``transport=auto`` moves them to processes.
WAITING_RATIO = 4.0


def _measured_layout(cfg: DictConfig, costs: Any, num_envs: int, workers: str, policy_device: str,
                     shareable: bool, concurrent: str) -> Any:
    """``transport=auto`` with measured costs: the best predicted layout this config allows."""
    from pipeline.plan.layout import choose

    if policy_device != "cpu":  # an accelerator: batching on it is the point of a central server
        servers: tuple[str, ...] = ("process", "thread") if shareable else ("thread",)
    else:
        servers = ("inline", "thread", "process")
    backend: str | None = None if workers == "auto" else workers
    if workers == "thread" and costs.env_wait_s > WAITING_RATIO * costs.env_cpu_s:
        backend = None  # mostly-waiting envs: thread workers would make each env wait for the others
    requested = cfg.env.envs_per_worker
    best, _ = choose(costs, num_envs, workers=backend, servers=servers,
                     envs_per_worker=None if requested is None else min(int(requested), num_envs),
                     shareable=shareable, concurrent=None if concurrent == "auto" else concurrent == "true")
    return best


def _measured_transport(chosen: Any, costs: Any, num_envs: int) -> Choice[str]:
    from pipeline.plan.layout import machine_limit

    # concurrent envs: the policy sees the envs that returned together, not the whole worker
    rows = chosen.detail.get("batch", chosen.envs_per_worker)
    return Choice("none" if chosen.server == "inline" else "slots", "auto.measured", {
        "layout": chosen, "num_envs": num_envs, "limit": machine_limit(costs, num_envs), "rows": rows,
        "env_wall_s": costs.env_wall_s, "env_cpu_s": costs.env_cpu_s, "infer_s": costs.infer_at(rows),
        "engine": costs.engine, "hop_s": costs.hop_s, "trainer_s": costs.trainer_s})


def _rule_transport(transport: str, workers: str, server: str, shareable: bool,
                    policy_device: str) -> tuple[Choice[str], str]:
    """``transport`` without a measurement (or given), and the server it leaves."""
    if transport != "auto":
        return Choice("slots", "given"), server
    if workers == "process" and server != "process":
        if shareable:
            return Choice("slots", "auto.slots_server_to_process"), "process"
        return Choice("slots", "auto.slots_server_unshareable", {"policy_device": policy_device}), server
    return Choice("slots", "auto.slots"), server


def _chunking(cfg: DictConfig, workers: str, num_envs: int, frames_per_batch: int, per_worker: int) -> Choice[int]:
    mode = str(cfg.chunking.mode)
    if mode == "fixed":
        return Choice(int(cfg.chunking.size), "fixed")
    if mode == "step":
        return Choice(1, "step")
    if workers == "process":
        return rules.chunk_len(num_envs, frames_per_batch, per_worker)
    return Choice(1, "auto.thread_workers")


def _lockstep_chunking(planned: Choice[int], num_envs: int, frames_per_batch: int, total_frames: int) -> Choice[int]:
    """deterministic=true: the planned chunk length, cut to one dividing a batch's steps per env (lockstep)."""
    turns = max(1, frames_per_batch // num_envs)
    last = (total_frames % frames_per_batch) // num_envs if total_frames > 0 else 0
    value = lockstep_chunk_len(planned.value, turns, last)
    if value == planned.value:
        return planned
    return Choice(value, "lockstep", {"planned": planned, "turns": turns})


def _collector(cfg: DictConfig) -> Choice[None]:
    c = cfg.collector
    return Choice(None, "collector", {
        "stall_timeout": c.stall_timeout, "yield_completed_trajectories": bool(c.yield_completed_trajectories),
        "reset_at_each_iter": bool(c.reset_at_each_iter), "post_collect_hook": c.post_collect_hook,
        "driver_affinity": list(c.driver_affinity or []), "policy_version": c.policy_version})


def resolve_plan(cfg: DictConfig, machine: Machine, env_spec: Any = None, costs: Any = None) -> Plan:
    """Turn ``cfg`` (already validated) into a :class:`Plan` for ``machine``.

    ``env_spec`` (the probed env's spec, optional) lets ``auto`` choices that
    depend on the observations (frame dedup) be made here, in the printed plan.
    ``costs`` (a :class:`pipeline.plan.layout.Costs` probe, optional) lets
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

    policy = rules.device(str(cfg.device.policy_device), machine.cuda)
    trainer = rules.device(str(cfg.device.trainer_device), machine.cuda)
    storing = rules.device(str(cfg.device.storing_device), machine.cuda).value
    policy_device = policy.value
    shareable = policy_device == "cpu" or policy_device.startswith("cuda")
    asked_splits = splits = int(cfg.workers.splits)
    deterministic = bool(OmegaConf.select(cfg, "deterministic", default=False))
    recurrent = recurrent_core(cfg)
    # lockstep collection needs blocks that step together; a recurrent state is carried by the block loop
    asked_concurrent = "false" if deterministic or recurrent else str(cfg.workers.concurrent_envs).lower()
    if recurrent and str(cfg.workers.concurrent_envs).lower() == "true":
        raise ConfigError(f"workers.concurrent_envs=true: a recurrent policy (model.rnn={recurrent}) is served "
                          "block by block; use workers.concurrent_envs=auto or false")
    # Without a measurement, envs step concurrently only when asked to.
    concurrent = asked_concurrent == "true"
    chosen: Any = None
    if server == "inline":
        if policy_device != "cpu":
            policy, policy_device = Choice("cpu", "inline.cpu", {"asked": policy}), "cpu"
        transport_choice = Choice("none", "inline")
        splits = 1
    elif transport == "auto" and costs is not None:
        chosen = _measured_layout(cfg, costs, num_envs, workers, policy_device, shareable, asked_concurrent)
        workers, server, splits, concurrent = chosen.workers, chosen.server, chosen.splits, chosen.concurrent
        transport_choice = _measured_transport(chosen, costs, num_envs)
    else:
        transport_choice, server = _rule_transport(transport, workers, server, shareable, policy_device)

    if concurrent:
        blocks = Choice(1, "concurrent.splits_reset" if splits != 1 else "concurrent", {"asked": splits})
    elif server == "inline" and chosen is None and asked_splits != 1:
        blocks = Choice(1, "inline.one_block", {"asked": asked_splits})
    else:
        blocks = Choice(splits, "blocks")
    splits = blocks.value
    if chosen is not None:
        per_worker_choice: Choice[int] = Choice(chosen.envs_per_worker, "auto.measured",
                                                {"workers": math.ceil(num_envs / chosen.envs_per_worker)})
    else:
        per_worker_choice = rules.envs_per_worker(cfg.env.envs_per_worker, num_envs, workers, machine.cpus, server)
    per_worker = per_worker_choice.value

    engine = serving_engine(cfg, policy_device, env_spec)
    max_batch = int(cfg.server.max_batch_size)
    block_rows = min(per_worker, num_envs)
    server_choice = Choice(server, server, {
        "device": policy, "engine": engine, "workers": math.ceil(num_envs / per_worker), "per_worker": per_worker,
        "rows": min(per_worker, max_batch), "min_batch": int(cfg.server.min_batch_size), "max_batch": max_batch,
        "passes": math.ceil(block_rows / max_batch) if max_batch < block_rows else 1})
    chunking = _chunking(cfg, workers, num_envs, frames_per_batch, per_worker)
    if deterministic:
        chunking = _lockstep_chunking(chunking, num_envs, frames_per_batch, int(cfg.trainer.total_frames))

    graph = GraphSpec(
        workers=workers,
        server=server,
        num_envs=num_envs,
        envs_per_worker=per_worker,
        chunk_len=chunking.value,
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
    if deterministic and (problem := lockstep_problem(graph, frames_per_batch, int(cfg.trainer.total_frames), 0)):
        raise ConfigError(f"deterministic=true: {problem}")

    choices: list[tuple[str, Choice]] = [
        ("workers", Choice(workers, "measured" if chosen is not None else "rule",
                           {"per_worker": per_worker_choice, "blocks": blocks, "workers": workers}))]
    if cfg.env.get("factories"):
        entries = [(str(e.get("task") or f"task{i}"), int(e.get("count", 1)), int(e.get("seed_offset") or 0))
                   for i, e in enumerate(cfg.env.factories)]
        choices.append(("tasks", Choice(len(entries), "env_set", {"entries": entries})))
    if env_spec is not None and getattr(env_spec, "action_mask", None):
        choices.append(("masks", Choice(str(env_spec.action_mask), str(env_spec.action_mask_source or "obs"),
                                        {"trainer": str(cfg.trainer.name)})))
    if recurrent:
        choices.append(("memory", _recurrent(cfg, min(per_worker, num_envs), chunking.value, env_spec)))
    evaluation = eval_settings(cfg)
    if evaluation.enabled:
        choices.append(("eval", Choice(evaluation.interval, "video" if evaluation.video else "eval",
                                       {"settings": evaluation})))
    if machine.total_cpus is not None:
        choices.append(("cpus", Choice(machine.cpus, "sweep_share",
                                       {"total": machine.total_cpus, "jobs": machine.sweep_jobs})))
    choices += [("transport", transport_choice), ("server", server_choice), ("chunking", chunking),
                ("device", Choice((policy_device, trainer.value, storing), "devices", {"trainer": trainer}))]
    dedup = None
    if cfg.replay.kind != "none":
        _check_disk_leaf_names(cfg, env_spec)
        dedup_choice = _frame_dedup(cfg, env_spec)
        dedup = dedup_choice.value
        choices.append(("replay", Choice(str(cfg.replay.kind), str(cfg.replay.kind), {
            "capacity": cfg.replay.capacity, "storage": str(cfg.replay.storage), "dedup": dedup_choice})))
    # what the collector does with dense_successors=False: cut successors need a chunk stream (not Ray, not concurrent envs)
    cut = (env_spec is not None and workers != "ray" and not graph.concurrent_envs
           and not dense_successors(cfg, env_spec))
    choices += [
        ("trainer", Choice(str(cfg.trainer.name), "trainer", {
            "frames_per_batch": frames_per_batch, "total_frames": cfg.trainer.total_frames,
            "target_return": cfg.trainer.target_return, "target_window": cfg.trainer.target_window,
            "cut_successors": cut})),
        ("collector", _collector(cfg)),
        *([("mode", Choice(True, "lockstep", {
            "turns": frames_per_batch // num_envs, "num_envs": num_envs,
            "concurrent_off": str(cfg.workers.concurrent_envs).lower() == "true",
            "restarts_off": int(cfg.workers.max_restarts),
            "checkpoint_frames": OmegaConf.select(cfg, "checkpoint.frames", default=None)}))] if deterministic else []),
        ("threads", Choice(graph.worker_threads, "local", {
            "torch_threads": int(cfg.torch_threads), "workers": workers, "server": server,
            "num_workers": graph.num_workers, "server_threads": int(cfg.server.num_threads)})),
    ]
    server_cfg = ServerConfig(
        max_batch_size=max_batch,
        min_batch_size=int(cfg.server.min_batch_size),
        timeout=float(cfg.server.timeout),
        stats_reservoir=int(cfg.server.stats_reservoir),
        device=policy_device,
        num_threads=int(cfg.server.num_threads),
        seed=int(cfg.seed),
        engine=engine.value,
        static_batch_size=cfg.server.static_batch_size if policy_device.startswith("cuda") else None,
        deterministic=deterministic,
    )
    envs = Choice(num_envs, "local", {"workers": graph.num_workers, "kind": workers, "per_worker": per_worker})
    return Plan(graph=graph, server=server_cfg, trainer_device=trainer.value, storing_device=storing,
                frame_dedup=dedup, choices=tuple(choices), envs=envs, layout=chosen, deterministic=deterministic)
