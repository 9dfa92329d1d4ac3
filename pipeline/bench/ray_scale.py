"""``python -m pipeline.bench.ray_scale REPORT``: how ``workers=ray`` would scale with nodes, from measured costs.

One machine cannot show a 16-node cluster, but it can measure what each
part of one costs, and the costs add up simply:

* **hosts**: a host core delivers what one core of this machine delivers
  (the benchmark's limit per CPU: one env step plus the policy's per-sample
  cost), so ``nodes x cores`` cores deliver that many times more;
* **driver**: every transition costs the driver CPU to receive and to cut into
  batches (``ray/driver_us_per_frame``, measured by the ``ours:ray``
  contender of the benchmark report), on one core;
* **network into the driver**: every transition's bytes
  (``ray/bytes_per_frame``), plus one weight copy per node per update
  (``frames_per_batch`` frames), through one link of ``--network-gbps``.

The prediction is the smallest of the three, with the bound named. It
leaves out the trainer's own time on the driver (a GPU learner overlaps
it) and Ray's scheduling under load; treat it as a ceiling.

    python -m pipeline.bench contenders=[ours:ray] bench_workload=pong      # writes the report
    python -m pipeline.bench.ray_scale runs/bench/<date>/<time>_pong/bench_pong.json --cores 16 --nodes 1 4 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.bench.ours import is_ray


def _median_trial(report: dict[str, Any], key: str) -> float | None:
    values = [t[key] for t in report["trials"] if is_ray(str(t.get("contender"))) and t.get("ok")
              and t.get(key) is not None]
    return statistics.median(values) if values else None


def weights_cost(workload: dict[str, Any], repeats: int = 20, address: str = "local") -> tuple[int, float]:
    """Bytes of the workload's policy weights and the median ``ray.put`` time of them (on the cluster at
    ``address``: ``local`` starts a loopback one)."""
    from components.envs import probe_env_spec
    from components.ray.cluster import RayCluster, import_ray
    from components.ray.host import numpy_weights
    from pipeline.bench.workload import env_factory, model_spec

    env_spec = probe_env_spec(env_factory(workload))
    weights = numpy_weights(model_spec(workload).build(env_spec).state_dict())
    size = sum(v.nbytes for v in weights.values())
    cluster = RayCluster(address, num_cpus=1 if address == "local" else None).connect()
    try:
        ray = import_ray()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            ray.put(weights)
            times.append(time.perf_counter() - started)
    finally:
        cluster.close()
    return size, statistics.median(times)


def scale_table(per_core_fps: float, driver_us: float, bytes_per_frame: float, weight_bytes: int, put_s: float,
                cores: int, nodes: list[int], gbps: float, frames_per_batch: int) -> list[dict[str, Any]]:
    """Predicted frames/s and its bound for each node count (see the module docstring).

    Examples:
        >>> rows = scale_table(1000.0, 10.0, 1000.0, 10**5, 0.001, 16, [1, 64], 10.0, 4096)
        >>> [(r["nodes"], round(r["fps"]), r["bound"]) for r in rows]
        [(1, 16000, 'hosts'), (64, 100000, 'driver CPU')]
    """
    link = gbps * 1e9 / 8
    out = []
    for n in nodes:
        hosts = n * cores * per_core_fps
        driver = 1e6 / driver_us
        # per frame: its bytes, plus a share of one weight copy per node per update
        network = link / (bytes_per_frame + weight_bytes * n / frames_per_batch)
        fps, bound = min((hosts, "hosts"), (driver, "driver CPU"), (network, "network into the driver"))
        updates = fps / frames_per_batch
        out.append({"nodes": n, "cores": n * cores, "fps": fps, "bound": bound, "hosts_fps": hosts,
                    "driver_fps": driver, "network_fps": network, "mb_per_s": fps * bytes_per_frame / 1e6,
                    "broadcast_mb_per_s": updates * weight_bytes * n / 1e6, "put_ms_per_s": 1e3 * updates * put_s})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.ray_scale", description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a benchmark report (bench_<workload>.json) with ours:ray trials")
    parser.add_argument("--cores", type=int, default=16, help="cores per node")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--network-gbps", type=float, default=10.0, help="the driver's link")
    parser.add_argument("--frames-per-batch", type=int, default=None, help="default: the workload's")
    parser.add_argument("--address", default="local",
                        help="the Ray cluster ray.put is timed on (default: a loopback one started for it)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
    except (OSError, ValueError) as err:
        print(f"error: {args.report}: cannot read the report ({err})", file=sys.stderr)
        return 2
    driver_us = _median_trial(report, "ray_driver_us_per_frame")
    bytes_per_frame = _median_trial(report, "ray_bytes_per_frame")
    limit = report.get("limit", {})
    if driver_us is None or bytes_per_frame is None or not limit.get("cpu_bound_fps"):
        print(f"error: {args.report} has no ours:ray trial with driver costs or no limit probe; run "
              "python -m pipeline.bench contenders=[ours:ray] first", file=sys.stderr)
        return 2
    per_core = float(limit["cpu_bound_fps"]) / float(limit["cpus"])
    workload = report["workload"]
    fpb = args.frames_per_batch or int(workload["frames_per_batch"])
    from components.ray.cluster import RayUnavailable

    try:
        weight_bytes, put_s = weights_cost(workload, address=args.address)
    except RayUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"measured on {report['machine']['cpu']} ({report['machine']['cpus']} CPUs), workload "
          f"{workload['name']}: {per_core:,.0f} frames/s per host core, driver {driver_us:.2f} us CPU per frame, "
          f"{bytes_per_frame:,.0f} bytes per frame, weights {weight_bytes / 1e6:.2f} MB (ray.put "
          f"{put_s * 1e3:.2f} ms), {fpb} frames per update, {args.network_gbps:g} Gb/s into the driver\n")
    print("| nodes | cores | predicted frames/s | bound | hosts could | driver CPU allows | network allows "
          "| chunk MB/s into the driver | weights MB/s out |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in scale_table(per_core, driver_us, bytes_per_frame, weight_bytes, put_s, args.cores, args.nodes,
                         args.network_gbps, fpb):
        print(f"| {r['nodes']} | {r['cores']} | {r['fps']:,.0f} | {r['bound']} | {r['hosts_fps']:,.0f} "
              f"| {r['driver_fps']:,.0f} | {r['network_fps']:,.0f} | {r['mb_per_s']:,.1f} "
              f"| {r['broadcast_mb_per_s']:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
