"""``python -m pipeline.bench.sac_update``: one SAC gradient step, the pipeline's against CleanRL's, side by side.

SAC on a CPU is bound by its learner (a 256x256 critic step costs
milliseconds, an env step microseconds), so what a gradient step costs
decides its wall time. This runs :meth:`components.trainers.sac.SACTrainer.learn`
and the reference's :meth:`pipeline.bench.reference_sac.Learner.update` on
the same random batch, in alternating rounds, and prints the median
milliseconds per step of each and their ratio, for the envs' shapes and the
thread counts asked for.

    python -m pipeline.bench.sac_update                      # Pendulum and HalfCheetah shapes, 1 and 2 threads
    python -m pipeline.bench.sac_update --shapes 17x6 --threads 2 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
from tensordict import TensorDict

from components.envs import EnvSpec
from components.sac_models import SquashedGaussianActor
from components.trainers.sac import SACTrainer
from pipeline.bench.reference_sac import Learner, parser as reference_parser


def _contenders(obs_dim: int, action_dim: int, hidden: int, batch: int, policy_frequency: int) -> dict:
    spec = EnvSpec((obs_dim,), "float32", "continuous", action_shape=(action_dim,), action_low=(-1.0,) * action_dim,
                   action_high=(1.0,) * action_dim)
    ours = SACTrainer(SquashedGaussianActor(spec, hidden=(hidden, hidden)), critic_hidden=[hidden, hidden],
                      batch_size=batch, policy_frequency=policy_frequency)
    args = reference_parser().parse_args(["--env-id", "-", "--out", "-", "--hidden", str(hidden),
                                          "--policy-frequency", str(policy_frequency)])
    reference = Learner(obs_dim, action_dim, -np.ones(action_dim), np.ones(action_dim), args)
    g = torch.Generator().manual_seed(0)
    obs, nxt = torch.randn(batch, obs_dim, generator=g), torch.randn(batch, obs_dim, generator=g)
    act, rew = torch.rand(batch, action_dim, generator=g) * 2 - 1, torch.randn(batch, generator=g)
    sample = TensorDict({"observation": obs, "action": act, ("next", "reward"): rew, ("next", "observation"): nxt,
                         ("next", "terminated"): torch.zeros(batch, dtype=torch.bool)}, [batch])
    done = torch.zeros(batch)
    return {"pipeline": lambda: ours.learn(sample), "reference": lambda: reference.update(obs, act, rew, nxt, done)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench.sac_update", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["3x1", "17x6"], help="observation x action sizes (Pendulum, HalfCheetah)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch intra-op threads")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--policy-frequency", type=int, default=2)
    p.add_argument("--steps", type=int, default=50, help="gradient steps per timing")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians over them)")
    args = p.parse_args(argv)
    print("| shape (obs x action) | threads | pipeline ms/step | reference ms/step | pipeline / reference |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        obs_dim, action_dim = (int(x) for x in shape.split("x"))
        for threads in args.threads:
            torch.set_num_threads(threads)
            contenders = _contenders(obs_dim, action_dim, args.hidden, args.batch, args.policy_frequency)
            for step in contenders.values():  # warm-up: allocations, optimiser state
                for _ in range(10):
                    step()
            times: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(args.rounds):
                for name, step in contenders.items():
                    started = time.perf_counter()
                    for _ in range(args.steps):
                        step()
                    times[name].append((time.perf_counter() - started) / args.steps * 1e3)
            ours, ref = (statistics.median(times[name]) for name in ("pipeline", "reference"))
            print(f"| {shape} | {threads} | {ours:.2f} | {ref:.2f} | {ours / ref:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
