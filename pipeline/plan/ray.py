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
from pipeline.plan.choice import Choice
from pipeline.plan.resolve import Machine, Plan
from pipeline.plan.rules import chunk_len as auto_chunk_len
from pipeline.plan.validate import ConfigError


def hosts_for(cfg: DictConfig, cluster_cpus: float) -> tuple[RayHostsSpec, Choice[int], Choice[int]]:
    """The hosts' spec for ``cfg`` on a cluster of ``cluster_cpus`` CPUs, with the host count's and chunk's choices."""
    r = cfg.ray
    num_envs = int(cfg.env.num_envs)
    per_host_cpus = float(r.num_cpus_per_actor)
    if r.num_actors is None:
        count = Choice(max(1, min(num_envs, int(cluster_cpus // per_host_cpus))), "auto.per_cpu",
                       {"cpus_per_host": per_host_cpus, "cluster_cpus": cluster_cpus})
    else:
        count = Choice(int(r.num_actors), "given")
        if count.value > num_envs:
            raise ConfigError(f"ray.num_actors={count.value}: more env hosts than env.num_envs={num_envs}")
    hosts = count.value
    fewest, most = num_envs // hosts, -(-num_envs // hosts)
    chunk = host_chunk_len(cfg, fewest, most)
    spec = RayHostsSpec(num_envs, hosts, chunk.value, in_flight=int(r.in_flight), cpus_per_host=per_host_cpus,
                        resources={str(k): float(v) for k, v in (r.resources or {}).items()},
                        scheduling=str(r.scheduling), local_workers=str(r.local_workers),
                        start_timeout=float(r.start_timeout))
    return spec, count, chunk


#: the one-line note a run that still sets ``ray.chunk_len`` prints
CHUNK_LEN_DEPRECATED = ("note: ray.chunk_len is deprecated and will be removed: chunking=fixed chunking.size=N says "
                        "the same for Ray hosts and local workers alike")


def host_chunk_len(cfg: DictConfig, fewest: int, most: int) -> Choice[int]:
    """Steps per host chunk from ``chunking`` (as for process workers), or the deprecated ``ray.chunk_len``."""
    import sys

    if cfg.ray.chunk_len is not None:
        print(CHUNK_LEN_DEPRECATED, file=sys.stderr, flush=True)
        return Choice(int(cfg.ray.chunk_len), "ray.chunk_len", {"unit": "chunk"})
    mode = str(cfg.chunking.mode)
    if mode == "fixed":
        return Choice(int(cfg.chunking.size), "fixed", {"unit": "chunk"})
    if mode == "step":
        return Choice(1, "step", {"unit": "chunk"})
    return auto_chunk_len(int(cfg.env.num_envs), int(cfg.trainer.frames_per_batch), fewest, most)


def ray_plan(cfg: DictConfig, plan: Plan, cluster: Any) -> tuple[Plan, RayHostsSpec]:
    """``plan`` (resolved as thread workers + inline) rewritten for env hosts on ``cluster``."""
    spec, count, chunk = hosts_for(cfg, cluster.total_cpus())
    rows = spec.rows
    per_host = f"{rows[0]}" if len(set(rows)) == 1 else f"{min(rows)}-{max(rows)}"
    replaced = {
        "workers": Choice("ray", "ray.hosts", {
            "hosts": count, "cpus_per_host": spec.cpus_per_host, "scheduling": spec.scheduling,
            "resources": spec.resources, "per_host": per_host, "local_workers": spec.local_workers}),
        "threads": Choice(1, "ray", {"torch_threads": int(cfg.torch_threads)}),
        "transport": Choice("ray", "ray.object_refs", {
            "chunk": chunk, "chunk_frames": spec.chunk_frames(), "in_flight": spec.in_flight}),
    }
    choices: list[tuple[str, Choice]] = [("cluster", Choice(None, "ray", {"described": cluster.describe()}))]
    for key, choice in plan.choices:
        if key == "chunking":  # said on the transport line: a host's chunk is its message
            continue
        if key == "server":
            choice = Choice(choice.value, choice.code, {**choice.facts, "hosts": True})
        choices.append((key, replaced.get(key, choice)))
    envs = Choice(spec.num_envs, "ray", {"hosts": spec.num_hosts, "per_host": per_host})
    return replace(plan, choices=tuple(choices), envs=envs), spec


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
