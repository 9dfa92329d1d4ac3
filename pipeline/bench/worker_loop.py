"""``python -m pipeline.bench.worker_loop``: CPU per frame of our worker processes and driver, against the hand loop.

Across processes a change of a few per cent drowns in trial noise (±5 %
of frames/s on the 2-CPU VM): how fast a trial runs depends on what else
the machine does. What a change to the worker loop saves is CPU per
frame, and that can be read off each process: this runs ``ours:auto``'s
graph (process workers, the policy inline in each) and, per round, reads
the CPU time (``/proc/<pid>/stat``) its worker processes and the driver
spent on the frames delivered in the round. Between its rounds the loop
``bare_procs`` runs in each of its processes (policy call, ``env.step``,
reset when done, ``obs[i] = observation``), here in the bench's own process
on its own envs with the same engine, alone on a CPU while the workers
wait for free chunks, so its wall time is its CPU time. Rounds alternate;
the table gives medians in microseconds per frame.

Linux only (``/proc``). Example::

    python -m pipeline.bench.worker_loop --envs 32 64 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: seconds each contender runs per round
SECONDS_PER_ROUND = 3.0
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: fields 14 and 15 of stat(5)


def _collector(num_envs: int, workers: int, frames_per_batch: int) -> Any:
    """``ours:auto``'s graph at ``num_envs`` envs in ``workers`` process workers (the policy inline in each)."""
    from pipeline.bench.ours import plan_for
    from pipeline.plan.model_spec import model_spec_for
    from pipeline.runner.collection import build_collector

    per_worker = -(-num_envs // workers)
    overrides = ["env=cartpole", f"env.num_envs={num_envs}", f"trainer.frames_per_batch={frames_per_batch}",
                 "workers=process", "server=inline", "transport=slots", f"env.envs_per_worker={per_worker}"]
    cfg, planned, _ = plan_for(overrides, count_trainer=False)
    return build_collector(cfg, planned.plan, planned.env_factory, planned.env_spec, model_spec_for(cfg),
                           seed=int(cfg.seed), total_frames=-1)


def contenders(num_envs: int, workers: int = 2, frames_per_batch: int = 4096,
               ) -> tuple[dict[str, Callable[[float], dict[str, float]]], Any]:
    """``{"ours", "hand"}``: each runs about ``seconds`` and returns CPU seconds per frame by part; and the collector."""
    from components.envs import probe_env_spec
    from pipeline.bench.bare import hand_step
    from pipeline.bench.workload import LoopPolicy, engine, env_factory

    collector = _collector(num_envs, workers, frames_per_batch)
    collector.start()
    driver = os.getpid()

    def run_ours(seconds: float) -> dict[str, float]:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:  # the backlog written while the hand loop ran is not this round's
            collector.next_batch()
        pids = collector.workers.pids
        before = [process_cpu_s(p) for p in (driver, *pids)]
        frames, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            frames += collector.next_batch().numel()
        after = [process_cpu_s(p) for p in (driver, *pids)]
        spent = [b - a for a, b in zip(before, after)]
        return {"worker": sum(spent[1:]) / frames, "driver": spent[0] / frames}

    workload = {"overrides": ["env=cartpole"], "num_envs": num_envs, "frames_per_batch": frames_per_batch}
    factory = env_factory(workload)
    rows = -(-num_envs // workers)  # one bare_procs process's share
    envs = [factory() for _ in range(rows)]
    policy = LoopPolicy(engine(workload, probe_env_spec(factory)), rows)
    obs = np.stack([env.reset(seed=i)[0] for i, env in enumerate(envs)])
    modes, done = np.zeros(rows, np.int8), np.zeros(rows, bool)

    def run_hand(seconds: float) -> dict[str, float]:
        started, frames, end = time.process_time(), 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            hand_step(envs, policy, obs, modes, done)
            frames += rows
        return {"worker": (time.process_time() - started) / frames, "driver": 0.0}

    return {"ours": run_ours, "hand": run_hand}, collector


def measure(num_envs: int, rounds: int, seconds: float = SECONDS_PER_ROUND, workers: int = 2) -> dict[str, float]:
    """Medians over ``rounds`` alternating rounds: ``ours_worker``, ``ours_driver`` and ``hand`` CPU s per frame."""
    from components.threads import pin_pools

    pin_pools(1)
    runs, collector = contenders(num_envs, workers)
    try:
        for run in runs.values():
            run(seconds / 4)  # warm-up: first calls allocate
        got: dict[str, list[float]] = {"ours_worker": [], "ours_driver": [], "hand": []}
        for r in range(rounds):
            for name in (["ours", "hand"] if r % 2 == 0 else ["hand", "ours"]):
                parts = runs[name](seconds)
                if name == "ours":
                    got["ours_worker"].append(parts["worker"])
                    got["ours_driver"].append(parts["driver"])
                else:
                    got["hand"].append(parts["worker"])
    finally:
        collector.shutdown()
    return {name: statistics.median(values) for name, values in got.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=SECONDS_PER_ROUND)
    args = parser.parse_args(argv)
    print("CPU us per frame (medians):")
    print("| envs | ours: workers | ours: driver | hand loop | workers / hand | (workers + driver) / hand |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.envs:
        got = measure(n, args.rounds, args.seconds, args.workers)
        w, d, h = got["ours_worker"] * 1e6, got["ours_driver"] * 1e6, got["hand"] * 1e6
        print(f"| {n} | {w:.2f} | {d:.2f} | {h:.2f} | {w / h:.3f} | {(w + d) / h:.3f} |", flush=True)


if __name__ == "__main__":
    main()
