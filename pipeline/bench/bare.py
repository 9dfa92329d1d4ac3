"""``bare_procs``: what this machine gives a workload with no collector at all.

The benchmark's limit adds an env step's CPU time and the policy's cost per
sample, each probed alone, and divides the CPUs by the sum. On a machine
whose cores share caches and memory bandwidth the two slow each other when
they run at once, so no layout reaches that sum; how far short it falls
depends on the workload and the machine, and cannot be told from the
probes. This contender measures it: one process per CPU, each stepping its
share of the envs one after another and running its own copy of the
policy on their observations, the loop a user would write by hand with
``multiprocessing``. Nothing is recorded, chunked, stamped or sent: each
process only adds its frames to its own shared counter. A collector's
ratio to it is what the collector's machinery costs (or, above 1, what
its layout gains: a loop of sequential steps wastes the wall time of envs
that wait).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

from components.threads import child_pools

#: seconds a process may take to build its envs and policy before the trial fails
START_TIMEOUT_S = 120.0
#: seconds the processes get, all together, to see the stop flag before they are killed
STOP_GRACE_S = 5.0


def split_rows(num_envs: int, processes: int) -> list[int]:
    """Envs per process, as even as they go (the first ones take the remainder).

    Examples:
        >>> split_rows(16, 2), split_rows(7, 3), split_rows(2, 4)
        ([8, 8], [3, 2, 2], [1, 1])
    """
    processes = max(1, min(processes, num_envs))
    base, extra = divmod(num_envs, processes)
    return [base + (i < extra) for i in range(processes)]


def _loop(workload: dict[str, Any], rows: int, seed: int, index: int, counts: Any, stop: Any, ready: Any,
          parent_pid: int) -> None:
    """One process: step ``rows`` envs in turn, one policy call per round, count frames in ``counts[index]``."""
    from components.envs import probe_env_spec
    from components.lifecycle import become_child
    from components.threads import pin_pools, report_pools
    from pipeline.bench.workload import LoopPolicy, engine, env_factory

    become_child(parent_pid)
    pin_pools(1)  # one loop per CPU: a pool per CPU in each would spin against the others
    factory = env_factory(workload)
    envs = [factory() for _ in range(rows)]
    policy = LoopPolicy(engine(workload, probe_env_spec(factory)), rows)
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)])
    modes = np.zeros(rows, np.int8)
    done = np.zeros(rows, bool)
    policy(obs, modes)  # the first call builds the engine's buffers
    report_pools(f"bare-{index}")
    ready.set()
    frames = 0
    while not stop.value:
        hand_step(envs, policy, obs, modes, done)
        frames += rows
        counts[index] = frames  # one writer per slot: no lock
    for env in envs:
        env.close()


def hand_step(envs: list[Any], policy: Any, obs: np.ndarray, modes: np.ndarray, done: np.ndarray) -> None:
    """One round of the hand loop: the policy on every observation, each env stepped (reset when done) in turn."""
    actions = policy(obs, modes)
    for i, env in enumerate(envs):
        observation, _, terminated, truncated, _ = env.step(actions[i])
        done[i] = terminated or truncated
        if done[i]:
            observation, _ = env.reset()
        obs[i] = observation
    policy.ended(done)


def _check_alive(processes: list[Any]) -> None:
    for i, process in enumerate(processes):
        if not process.is_alive():
            raise RuntimeError(f"bare_procs: process {i} exited with code {process.exitcode}")


def run_bare(workload: dict[str, Any], num_envs: int, warmup: float, seconds: float, cpus: int) -> dict[str, Any]:
    """Frames per second of one hand-written loop per CPU (at most one per env) over ``seconds``."""
    rows = split_rows(num_envs, cpus)
    ctx = mp.get_context("spawn")
    counts = ctx.RawArray("q", len(rows))
    stop = ctx.RawValue("b", 0)
    ready = [ctx.Event() for _ in rows]
    processes = [ctx.Process(target=_loop, args=(workload, n, sum(rows[:i]), i, counts, stop, ready[i], os.getpid()),
                             name=f"bare-{i}", daemon=True) for i, n in enumerate(rows)]
    try:
        with child_pools(1):
            for process in processes:
                process.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for event in ready:
            while not event.wait(0.2):
                _check_alive(processes)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bare_procs: a process was not ready after {START_TIMEOUT_S:.0f} s")
        time.sleep(warmup)
        _check_alive(processes)
        before, start = sum(counts), time.perf_counter()
        time.sleep(seconds)
        after, elapsed = sum(counts), time.perf_counter() - start
        _check_alive(processes)  # a process that died mid-trial would have made the count too small
    finally:
        stop.value = 1  # a loop sees it within one round; a hung env never does
        deadline = time.monotonic() + STOP_GRACE_S
        for process in processes:
            if process.pid is not None:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    return {"frames": after - before, "seconds": elapsed,
            "graph": {"processes": len(rows), "envs_per_process": rows}}
