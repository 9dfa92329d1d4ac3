"""The ``ours:*`` contenders: a command's overrides, planned and built as ``python -m pipeline`` would.

A contender name is shorthand for overrides on top of the workload's:

* ``ours:auto``: the runner's own ``workers=auto transport=auto``, planned
  for what the benchmark runs: collection alone (the trainer's cost left
  out, as nothing trains here). What the collector does with the whole
  machine, the contender to hold against the hand loops. Its command
  spells the chosen layout out: a training run of the bare command plans
  for its trainer and may pick another;
* ``ours:train``: the bare command, planned as a training run plans it
  (the trainer's cost included), collecting alone: what the layout a
  training run takes collects when its trainer does not compete (on 2
  CPUs often one worker, leaving a CPU to the trainer);
* ``ours:<workers>/<transport>/<server>/<chunking>[@opt=value,...]``: a fixed
  layout, ``workers=<workers> server=<server> transport=slots
  chunking=<chunking>`` (the transport part is ``slots``, or ``none`` with
  ``server=inline``), options from :data:`OPTIONS`;
* ``ours:ray``: ``workers=ray ray.address=local`` (a loopback cluster
  started in the trial, one env host per CPU); ``ours:ray@address=HOST:PORT``
  joins a running cluster instead (its hosts, its network), as
  ``ray.address=HOST:PORT`` does.

The trial composes the config, validates it, plans it with the runner's
probes and rules (:func:`pipeline.plan.inputs.plan_config`) and builds the
collector with :func:`pipeline.runner.collection.build_collector`, then only takes
batches: what it measures is the collector of the printed command, minus
the learner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from components.kinds import ChunkingMode, ServerKind, WorkerKind
from pipeline.bench.workload import base_overrides, command

#: ``@key=value`` options of a contender name -> the config key they set
OPTIONS = {"epw": "env.envs_per_worker", "splits": "workers.splits", "minb": "server.min_batch_size",
           "timeout": "server.timeout", "threads": "server.num_threads", "nice": "workers.nice",
           "graph": "server.static_batch_size", "conc": "workers.concurrent_envs"}
_WORKERS = WorkerKind.words()
_SERVERS = ServerKind.words()
_CHUNKING = (ChunkingMode.auto.value, ChunkingMode.step.value)  # fixed needs a size: not a contender word


def layout_overrides(name: str) -> list[str]:
    """The overrides a contender name stands for (beyond the workload's); a ``ValueError`` for a bad name.

    Examples:
        >>> layout_overrides("ours:process/slots/thread/step@epw=4,conc=1")
        ['workers=process', 'server=thread', 'transport=slots', 'chunking=step', 'env.envs_per_worker=4', 'workers.concurrent_envs=true']
    """
    if name in ("ours:auto", "ours:train"):
        return []
    if is_ray(name):
        options = name.partition("@")[2]
        key, _, address = options.partition("=")
        if options and (key != "address" or not address):
            raise ValueError(f"{name}: ours:ray takes one option, @address=HOST:PORT (got {options!r})")
        return ["workers=ray", f"ray.address={address or 'local'}"]
    body, _, options = name.removeprefix("ours:").partition("@")
    parts = body.split("/")
    if len(parts) != 4:
        raise ValueError(f"{name}: expected ours:<workers>/<transport>/<server>/<chunking>")
    workers, transport, server, chunking = parts
    if workers not in _WORKERS or server not in _SERVERS or chunking not in _CHUNKING:
        raise ValueError(f"{name}: workers one of {_WORKERS}, server one of {_SERVERS}, chunking one of {_CHUNKING}")
    if transport not in ("slots", "none") or (transport == "none") != (server == "inline"):
        raise ValueError(f"{name}: the transport part is 'slots', or 'none' with server inline (got {transport!r})")
    out = [f"workers={workers}", f"server={server}", "transport=slots", f"chunking={chunking}"]
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key not in OPTIONS or not value:
            raise ValueError(f"{name}: unknown option {item!r} (options: {', '.join(OPTIONS)})")
        if key == "conc":
            value = "true" if value in ("1", "true") else "false"
        out.append(f"{OPTIONS[key]}={value}")
    return out


def is_ray(name: str) -> bool:
    """Whether a contender goes through Ray env hosts (``ours:ray``, with or without its address).

    Examples:
        >>> is_ray("ours:ray"), is_ray("ours:ray@address=10.0.0.1:6379"), is_ray("ours:auto")
        (True, True, False)
    """
    return name == "ours:ray" or name.startswith("ours:ray@")


def ours_overrides(name: str, workload: dict[str, Any], num_envs: int) -> list[str]:
    """The whole command line of a contender at ``num_envs`` envs."""
    return base_overrides(workload, num_envs) + layout_overrides(name)


def plan_for(overrides: list[str], count_trainer: bool = True) -> tuple[Any, Any, Any]:
    """(config, :class:`~pipeline.plan.inputs.PlannedConfig`, machine) of a command, as the runner plans it.

    ``count_trainer=False``: planned for collection alone (``ours:auto``).
    """
    from components.threads import pin_pools
    from pipeline.plan import Machine
    from pipeline.plan.inputs import compose, plan_config
    from pipeline.plan.validate import validate

    cfg = compose(overrides)
    machine = Machine.detect()
    validate(cfg, cuda_available=machine.cuda, cuda_count=machine.cuda_count)
    pin_pools(int(cfg.torch_threads))  # as run() does before the probes time the policy
    return cfg, plan_config(cfg, machine, count_trainer), machine


def layout_words(layout: Any) -> list[str]:
    """The overrides that build ``layout`` whatever the plan would choose (``ours:auto``'s command).

    Examples:
        >>> from pipeline.plan.layout import Layout
        >>> layout_words(Layout("process", "inline", 32))
        ['workers=process', 'server=inline', 'transport=slots', 'env.envs_per_worker=32']
        >>> layout_words(Layout("process", "process", 8, splits=2))[-1]
        'workers.splits=2'
    """
    out = [f"workers={layout.workers}", f"server={layout.server}", "transport=slots",
           f"env.envs_per_worker={layout.envs_per_worker}"]
    if layout.splits > 1:
        out.append(f"workers.splits={layout.splits}")
    if layout.concurrent:
        out.append("workers.concurrent_envs=true")
    return out


def run_ours(name: str, workload: dict[str, Any], num_envs: int, warmup: float, seconds: float) -> dict[str, Any]:
    """One trial of an ``ours:*`` contender: frames/s of the collector its command builds."""
    from pipeline.plan.model_spec import model_spec_for
    from pipeline.runner.collection import build_collector

    overrides = ours_overrides(name, workload, num_envs)
    collect_only = name == "ours:auto"
    cfg, planned, machine = plan_for(overrides, count_trainer=not collect_only)
    plan, cluster, hosts = planned.plan, None, None
    try:
        if str(cfg.workers.backend) == "ray":
            from pipeline.plan.ray import connect_ray

            cluster, plan, hosts = connect_ray(cfg, plan, machine)
        collector = build_collector(cfg, plan, planned.env_factory, planned.env_spec, model_spec_for(cfg),
                                    seed=int(cfg.seed), total_frames=-1, ray_hosts=(cluster, hosts))
        if hosts is not None:
            graph = {"workers": "ray", "server": "inline", "hosts": hosts.num_hosts, "envs_per_host": hosts.rows[0],
                     "chunk_len": hosts.chunk_len, "in_flight": hosts.in_flight}
        else:
            graph = dict(plan.graph.__dict__)
        shown = overrides + layout_words(plan.layout) if collect_only and plan.layout is not None else overrides
        choice: dict[str, Any] = {"command": command(shown)}
        if plan.layout is not None:
            # the bench trains nothing: what it measures is the layout's collection alone, so that is what it
            # is predicted at; the plan's own figure (bounded by the trainer it counted) is kept beside it
            from dataclasses import replace

            from pipeline.plan.layout import predict

            alone = predict(plan.layout, replace(planned.costs, trainer_s=0.0), num_envs).predicted_fps
            choice.update(choice=plan.layout.describe(num_envs), predicted_fps=alone,
                          plan_predicted_fps=plan.layout.predicted_fps, costs=planned.costs.as_dict())
        return measure(collector, warmup, seconds, graph, choice)
    finally:
        if cluster is not None:
            cluster.close()


def timed(step: Callable[[], int], warmup: float, seconds: float) -> tuple[int, float]:
    """Run ``step`` (returns frames) for ``warmup`` s untimed, then ``seconds`` s timed."""
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        step()
    frames, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        frames += step()
    return frames, time.perf_counter() - start


def measure(collector: Any, warmup: float, seconds: float, graph: dict[str, Any],
            choice: dict[str, Any]) -> dict[str, Any]:
    """Frames a collector delivers in ``seconds`` after ``warmup``, with its statistics; shuts it down."""
    try:
        collector.start()

        def step() -> int:
            return collector.next_batch().numel()

        # The first batch can take seconds (the driver's first tensordict import) while the workers fill
        # every chunk; the warm-up starts after it, so no backlog collected before it is timed.
        step()
        timed(step, warmup, 0.0)
        collector.server_stats(reset=True)
        collector.worker_stats()
        frames, elapsed = timed(step, 0.0, seconds)
        stats = collector.server_stats()
        workers = collector.worker_stats()
    finally:
        collector.shutdown()
    return {
        "frames": frames, "seconds": elapsed, "graph": graph, **choice,
        "server_avg_batch_size": stats.get("avg_batch_size"), "server_forward_p50_ms": stats.get("forward_p50_ms"),
        "worker_env_frac": workers.get("env_frac"), "worker_infer_wait_frac": workers.get("infer_wait_frac"),
        "worker_chunk_wait_frac": workers.get("chunk_wait_frac"),
        **{k.replace("/", "_"): v for k, v in workers.items() if k.startswith("ray/") and "node_frames" not in k},
    }
