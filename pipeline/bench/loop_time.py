"""``python -m pipeline.bench.loop_time``: CPU time a step of our worker loop takes against the hand loop's, in one thread.

:mod:`pipeline.bench.loop_instructions` counts instructions, which do not
move with the VM; but they understate what the block step's own work
costs: on a 16-env CartPole block ours executes ~6 % more instructions than
the hand loop and takes 12-15 % more time, since its extra work is many
small numpy calls, which run at a fraction of the interpreter's rate. This
times the two loops themselves, each with the workload's real policy
engine (the numpy MLP ``server.engine=auto`` picks), in this process and
one thread, alternating short runs: hand, ours, hand per round, so a drift
of the VM's speed falls on both. A round's ratio is ours over the mean of
its two hand runs; the table gives the median over rounds, which is steady
to about 0.01 where frames/s of whole trials move by 5-10 %.

* ``ours``: the real worker loop (:func:`components.collector.worker.run_loop`)
  over one block, the policy inline with the engine, each chunk released
  as soon as it is committed;
* ``hand``: ``bare_procs``' loop (:func:`pipeline.bench.bare.hand_step`)
  with the same engine, as each ``bare_procs`` process runs it.

Example::

    python -m pipeline.bench.loop_time --envs 16 32 --rounds 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np


def _cartpole() -> Any:
    import gymnasium as gym

    return gym.make("CartPole-v1")


def policy_engine() -> Any:
    """The CartPole workload's policy in the engine ``server.engine=auto`` serves it with (the numpy MLP)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from components.envs import probe_env_spec
    from pipeline.bench.workload import engine

    workload = OmegaConf.to_container(OmegaConf.load(Path(__file__).parent / "conf/bench_workload/cartpole.yaml"))
    return engine(workload, probe_env_spec(_cartpole))


def time_ours(engine: Any, n: int, steps: int) -> tuple[float, int]:
    """CPU seconds a step of our loop takes over ``n`` CartPole envs (``steps`` of them), and the steps taken."""
    from components.envs import EnvSpec
    from pipeline.bench.loop_instructions import run_requests
    from pipeline.plan.loop_probe import inline_loop

    spec = EnvSpec.from_env(_cartpole())
    response = {"action": spec.zero_actions(n), "sample_log_prob": np.zeros(n, np.float32),
                "state_value": np.zeros(n, np.float32)}
    loop = inline_loop(spec, response, _cartpole, n)
    loop.channel.policy.built_with(engine)
    started = time.process_time()
    taken = run_requests(loop, steps + 1)  # the request after the last step stops it
    return (time.process_time() - started) / max(1, taken), taken


def time_hand(engine: Any, n: int, steps: int) -> float:
    """CPU seconds a step of the hand loop takes over ``n`` CartPole envs."""
    from pipeline.bench.bare import hand_step
    from pipeline.bench.workload import LoopPolicy

    envs = [_cartpole() for _ in range(n)]
    obs = np.stack([env.reset(seed=i)[0] for i, env in enumerate(envs)])
    policy, modes, done = LoopPolicy(engine, n), np.zeros(n, np.int8), np.zeros(n, bool)
    policy(obs, modes)  # the first call builds the engine's buffers
    started = time.process_time()
    for _ in range(steps):
        hand_step(envs, policy, obs, modes, done)
    elapsed = time.process_time() - started
    for env in envs:
        env.close()
    return elapsed / steps


def compare(n: int, rounds: int, steps: int, engine: Any | None = None) -> dict[str, float]:
    """Median microseconds a step of each loop and the median per-round ratio ours / hand."""
    engine = policy_engine() if engine is None else engine
    ours, hands, ratios = [], [], []
    for _ in range(rounds):
        before = time_hand(engine, n, steps)
        mine, _ = time_ours(engine, n, steps)
        after = time_hand(engine, n, steps)
        ours.append(mine)
        hands += [before, after]
        ratios.append(mine / ((before + after) / 2))
    return {"ours_us": statistics.median(ours) * 1e6, "hand_us": statistics.median(hands) * 1e6,
            "ratio": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[16])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args(argv)
    # one loop per CPU in the trials this stands for: the engine's pools pinned to one thread, as there
    from components.threads import pin_pools

    pin_pools(1)
    engine = policy_engine()
    print(f"CPU time a step, one thread, {args.rounds} rounds of {args.steps} steps (pid {os.getpid()}):")
    print("| envs | ours (us) | hand loop (us) | ours / hand (median of rounds) | rounds' range |")
    print("|---:|---:|---:|---:|---|")
    for n in args.envs:
        r = compare(n, args.rounds, args.steps, engine)
        print(f"| {n} | {r['ours_us']:,.1f} | {r['hand_us']:,.1f} | {r['ratio']:.3f} | {r['low']:.3f}-{r['high']:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
