"""The plan for ``workers=ray``: how many env hosts, which envs each holds, chunk size, and where they landed.

The rest of the plan (devices, the trainer, replay, the serving engine) is
the local one, resolved as for thread workers with ``server=inline``: a
host is exactly such a graph, run inside a Ray actor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from components.ray.hosts_spec import RayHostsSpec
from pipeline.plan.resolve import Machine, Plan
from pipeline.plan.rules import chunk_len as auto_chunk_len
from pipeline.validate import ConfigError


def hosts_for(cfg: DictConfig, cluster_cpus: float) -> tuple[RayHostsSpec, list[str]]:
    """The hosts' spec for ``cfg`` on a cluster of ``cluster_cpus`` CPUs, and why."""
    r = cfg.ray
    num_envs = int(cfg.env.num_envs)
    per_host_cpus = float(r.num_cpus_per_actor)
    why = []
    if r.num_actors is None:
        hosts = max(1, min(num_envs, int(cluster_cpus // per_host_cpus)))
        why.append(f"auto -> {hosts}: one per {per_host_cpus:g} CPU(s) of the cluster's {cluster_cpus:g}, "
                   f"at most num_envs")
    else:
        hosts = int(r.num_actors)
        if hosts > num_envs:
            raise ConfigError(f"ray.num_actors={hosts}: more env hosts than env.num_envs={num_envs}")
        why.append(f"{hosts}")
    fewest, most = num_envs // hosts, -(-num_envs // hosts)
    chunk_len, chunk_why = host_chunk_len(cfg, fewest, most)
    spec = RayHostsSpec(num_envs, hosts, chunk_len, in_flight=int(r.in_flight), cpus_per_host=per_host_cpus,
                        resources={str(k): float(v) for k, v in (r.resources or {}).items()},
                        scheduling=str(r.scheduling), local_workers=str(r.local_workers),
                        start_timeout=float(r.start_timeout))
    return spec, [why[0], chunk_why]


#: the one-line note a run that still sets ``ray.chunk_len`` prints
CHUNK_LEN_DEPRECATED = ("note: ray.chunk_len is deprecated and will be removed: chunking=fixed chunking.size=N says "
                        "the same for Ray hosts and local workers alike")


def host_chunk_len(cfg: DictConfig, fewest: int, most: int) -> tuple[int, str]:
    """Steps per host chunk from ``chunking`` (as for process workers), or the deprecated ``ray.chunk_len``."""
    import sys

    if cfg.ray.chunk_len is not None:
        print(CHUNK_LEN_DEPRECATED, file=sys.stderr, flush=True)
        return int(cfg.ray.chunk_len), f"ray.chunk_len: {int(cfg.ray.chunk_len)} steps per chunk"
    mode = str(cfg.chunking.mode)
    if mode == "fixed":
        return int(cfg.chunking.size), f"fixed: {cfg.chunking.size} steps per chunk"
    if mode == "step":
        return 1, "step: every step is a chunk (a round trip per step: slow)"
    return auto_chunk_len(int(cfg.env.num_envs), int(cfg.trainer.frames_per_batch), fewest, most)


def ray_plan(cfg: DictConfig, plan: Plan, cluster: Any) -> tuple[Plan, RayHostsSpec]:
    """``plan`` (resolved as thread workers + inline) rewritten for env hosts on ``cluster``."""
    spec, (hosts_why, chunk_why) = hosts_for(cfg, cluster.total_cpus())
    rows = spec.rows
    per_host = f"{rows[0]}" if len(set(rows)) == 1 else f"{min(rows)}-{max(rows)}"
    local = "one worker thread" if spec.local_workers == "thread" else "worker processes"
    text = {
        "workers": f"ray: {hosts_why} env host(s) (Ray actors of {spec.cpus_per_host:g} CPU(s), "
                   f"{spec.scheduling} placement{', resources ' + str(spec.resources) if spec.resources else ''}), "
                   f"{per_host} envs each stepped by {local}",
        "threads": f"driver {int(cfg.torch_threads)} (torch_threads: trainer), each env host 1 (its envs and policy "
                   "copy in turn), metric sinks 1; pinned in each process",
        "transport": f"Ray object refs: {chunk_why} ({', '.join(str(f) for f in spec.chunk_frames())} transitions), "
                     f"1-{spec.in_flight} chunk request(s) in flight per host (one batch made ahead at most); weights: one ray.put per update",
    }
    reasons = []
    for key, value in plan.reasons:
        if key in text:
            value = text.pop(key)
        elif key == "server":
            value = value.replace("each of the 1 env worker(s) (its own copy)", "every env host (its own copy)")
        elif key == "chunking":
            continue
        reasons.append((key, value))
    reasons += list(text.items())
    reasons.insert(0, ("cluster", cluster.describe()))
    line = f"envs      {spec.num_envs} in {spec.num_hosts} ray env host(s) of {per_host}"
    return replace(plan, reasons=tuple(reasons), envs_line=line), spec


def placement_lines(where: list[dict[str, Any]], nodes: list[Any]) -> list[str]:
    """Where the hosts landed, per node (printed once they run)."""
    address = {n.node_id: n.address for n in nodes}
    by_node: dict[str, list[dict[str, Any]]] = {}
    for host in where:
        by_node.setdefault(host["node_id"], []).append(host)
    out = []
    for node, hosts in by_node.items():
        envs = ", ".join(f"host {h['host']} envs {h['envs'][0]}-{h['envs'][1]}" for h in hosts)
        out.append(f"  node {node[:8]} ({address.get(node, '?')}): {envs}")
    return out


def connect_ray(cfg: DictConfig, plan: Plan, machine: Machine) -> tuple[Any, Plan, Any]:
    """Reach the cluster ``ray.address`` names and plan the env hosts on it (a failure is one line)."""
    from components.ray.cluster import RayCluster, RayUnavailable

    r = cfg.ray
    cluster = RayCluster(str(r.address), num_cpus=machine.cpus,
                         runtime_env=OmegaConf.to_container(r.runtime_env, resolve=True) if r.runtime_env else None,
                         object_store_memory=r.object_store_memory)
    try:
        cluster.connect()
        plan, hosts = ray_plan(cfg, plan, cluster)
    except RayUnavailable as err:
        cluster.close()
        raise ConfigError(str(err)) from None
    except BaseException:
        cluster.close()
        raise
    return cluster, plan, hosts
