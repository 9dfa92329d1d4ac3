"""``python -m pipeline.bench.block``: what an env block adds to a bare ``env.step`` loop, in one process.

Across processes on a small machine the gap between ``ours:auto`` and
``bare_procs`` drowns in trial noise (±40 % on the 2-CPU VM). This times
the part of it a worker adds per env step, where nothing else runs: an
:class:`~components.collector.env_block.EnvBlock` stepping its envs into an
observation stream (its checks, episode counters, finals and resets)
against the hand loop ``bare_procs`` runs (``env.step``, reset when done,
``obs[i] = observation``), each on its own envs, alternating in rounds
(order reversed every other round), medians.

Example::

    python -m pipeline.bench.block --envs 8 32 128 512 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

#: env steps each contender takes per round (split over the block's envs)
STEPS_PER_ROUND = 96_000
#: stream steps the block cycles through, as a chunk of that length would
STREAM_STEPS = 64


def contenders(env_id: str, num_envs: int, seed: int = 0) -> dict[str, Callable[[int], float]]:
    """``{"block", "bare"}``: each takes a number of block steps and returns seconds per env step."""
    from components.collector.env_block import EnvBlock
    from components.envs import GymEnvFactory

    factory = GymEnvFactory(env_id)
    block = EnvBlock(factory, env_ids=list(range(num_envs)), seeds=[seed + i for i in range(num_envs)])
    spec = block.spec
    stream = np.zeros((STREAM_STEPS + 1, num_envs, *spec.obs_shape), spec.obs_dtype)
    block.reset(stream[0])
    rows = block.empty_rows()
    envs = [factory() for _ in range(num_envs)]
    obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)])
    for i, env in enumerate(envs):
        env.action_space.seed(seed + i)
    actions = np.stack([np.stack([env.action_space.sample() for env in envs]) for _ in range(STREAM_STEPS)])

    position = [0]  # the stream step the block writes next, across calls

    def run_block(steps: int) -> float:
        started = time.perf_counter()
        t = position[0]
        for _ in range(steps):
            if t == STREAM_STEPS:
                stream[0] = stream[STREAM_STEPS]  # the next chunk starts where this one ended
                t = 0
            block.step(actions[t], rows, stream[t + 1], acted=stream[t])
            t += 1
        position[0] = t
        return (time.perf_counter() - started) / (steps * num_envs)

    def run_bare(steps: int) -> float:
        started = time.perf_counter()
        for k in range(steps):
            step_actions = actions[k % STREAM_STEPS]
            for i, env in enumerate(envs):
                observation, _, terminated, truncated, _ = env.step(step_actions[i])
                if terminated or truncated:
                    observation, _ = env.reset()
                obs[i] = observation
        return (time.perf_counter() - started) / (steps * num_envs)

    return {"block": run_block, "bare": run_bare}


def measure(env_id: str, num_envs: int, rounds: int) -> dict[str, float]:
    """Median seconds per env step of each contender over ``rounds`` alternating rounds."""
    runs = contenders(env_id, num_envs)
    steps = max(1, STEPS_PER_ROUND // num_envs)
    for run in runs.values():
        run(max(1, steps // 10))  # warm: caches, the first resets
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            times[name].append(runs[name](steps))
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--envs", type=int, nargs="+", default=[8, 32, 128, 512])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"{args.env}, one process, medians of {args.rounds} alternating rounds")
    print("| envs per block | EnvBlock us/step | hand loop us/step | added us/step | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.envs:
        m = measure(args.env, n, args.rounds)
        block, bare = m["block"] * 1e6, m["bare"] * 1e6
        print(f"| {n} | {block:.2f} | {bare:.2f} | {block - bare:+.2f} | {block / bare:.3f} |", flush=True)


if __name__ == "__main__":
    main()
