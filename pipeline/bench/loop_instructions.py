"""``python -m pipeline.bench.loop_instructions``: instructions per step of our worker loop and the hand loop.

Frames per second and CPU time per frame move by ±10 % between
invocations on a shared 2-CPU VM, more than most changes to the worker
loop are worth; the instructions a loop executes do not move. This runs
each loop in one thread for a fixed number of steps under valgrind (the
``cachegrind`` tool with its cache simulation off, so only instructions are
counted), once for ``steps`` and once for three times as many, and reports
the difference over ``2 * steps``: the instructions of one step, with the
interpreter's start and the imports subtracted.

The loops, each over one block of ``n`` envs, with a policy that answers
fixed arrays in no time (the policy's own cost is the same in both):

* ``ours``: the real worker loop (:func:`components.collector.worker.run_loop`)
  with its policy inline, as ``ours:auto`` runs it at 16 to 1,024 envs,
  each chunk released as soon as it is committed (what the driver does);
* ``hand``: ``bare_procs``' loop (:func:`pipeline.bench.bare.hand_step`).

Envs: ``cartpole`` (``gym.make``, as ``bare_procs`` builds them; our block
steps what is under ``gym.make``'s wrappers) or ``null`` (envs that step in
no time: what remains is each loop's own work).

Linux with valgrind only (Debian: ``apt-get install valgrind``). Example::

    python -m pipeline.bench.loop_instructions --envs 1 16 --steps 1000
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import numpy as np

LOOPS = ("ours", "hand")
ENVS = ("cartpole", "null")
#: what cachegrind prints for the instructions executed
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def _cartpole() -> Any:
    import gymnasium as gym

    return gym.make("CartPole-v1")


def run_steps(loop: str, kind: str, n: int, steps: int) -> int:
    """Take exactly ``steps`` steps of ``loop`` over ``n`` envs of ``kind``; returns the steps taken."""
    from components.envs import EnvSpec
    from pipeline.plan.loop_probe import NullEnv, env_observation

    spec = EnvSpec.from_env(_cartpole())
    make = _cartpole
    if kind == "null":
        obs_space, action_space = spec.spaces()
        returned = env_observation(spec)
        make = lambda: NullEnv(returned, action_space, obs_space)  # noqa: E731
    actions = spec.zero_actions(n)
    if loop == "hand":
        from pipeline.bench.bare import hand_step

        envs = [make() for _ in range(n)]
        obs = np.stack([env.reset(seed=i)[0] for i, env in enumerate(envs)])
        policy = _FixedActions(actions)
        modes, done = np.zeros(n, np.int8), np.zeros(n, bool)
        for _ in range(steps):
            hand_step(envs, policy, obs, modes, done)
        return steps
    return _run_ours(spec, make, n, steps, actions)


class _FixedActions:
    """The hand loop's policy: the same actions every call."""

    def __init__(self, actions: np.ndarray) -> None:
        self.actions = actions

    def __call__(self, obs: np.ndarray, modes: np.ndarray) -> np.ndarray:
        return self.actions

    def ended(self, done: np.ndarray) -> None:
        pass


def _run_ours(spec: Any, make: Any, n: int, steps: int, actions: np.ndarray) -> int:
    from pipeline.plan.loop_probe import inline_loop

    response = {"action": actions, "sample_log_prob": np.zeros(n, np.float32),
                "state_value": np.zeros(n, np.float32)}
    return run_requests(inline_loop(spec, response, make, n), steps)


def run_requests(loop: Any, requests: int) -> int:
    """Run an :func:`~pipeline.plan.loop_probe.inline_loop` until its ``requests``-th request; the steps it took.

    A request goes out before the first step and after each, so that is
    ``requests - 1`` steps (what the loop's own step count says is
    returned). Each chunk is released as soon as it is
    committed: the driver's part, in this thread, so no second thread's
    work is counted.
    """
    commit, submit, taken = loop.writer.commit, loop.channel.submit, [0]

    def commit_and_release() -> None:
        commit()
        gid = loop.pool.next_ready(0.0)
        if gid is not None:
            loop.pool.release(gid)

    def counted(*args: Any, **kwargs: Any) -> None:
        taken[0] += 1
        if taken[0] >= requests:
            loop.control.stop[0] = 1
        submit(*args, **kwargs)

    loop.writer.commit, loop.channel.submit = commit_and_release, counted
    try:
        loop.run()
    finally:
        loop.block.close()
    return int(loop.control.timing[0][3])


def instructions(loop: str, kind: str, n: int, steps: int) -> float:
    """Instructions one step of ``loop`` executes (valgrind), start-up and imports subtracted."""
    counts = []
    for k in (steps, 3 * steps):
        env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                               sys.executable, "-m", "pipeline.bench.loop_instructions", "--child", loop, kind,
                               str(n), str(k)], capture_output=True, text=True, env=env, timeout=1800)
        found = _REFS.search(done.stderr)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"{loop} over {n} {kind} envs under valgrind: exit {done.returncode}: "
                               f"{done.stderr.strip().splitlines()[-1:]}")
        counts.append(int(found.group(1).replace(",", "")))
    return (counts[1] - counts[0]) / (2 * steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--kinds", nargs="+", choices=ENVS, default=list(ENVS))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--child", nargs=4, metavar=("LOOP", "KIND", "N", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        loop, kind, n, steps = args.child
        run_steps(loop, kind, int(n), int(steps))
        return
    if shutil.which("valgrind") is None:
        sys.exit("error: valgrind is not installed (Debian: apt-get install valgrind)")
    print("instructions per step (valgrind, one thread):")
    print("| envs | kind | ours | hand loop | ours - hand | ours / hand |")
    print("|---:|---|---:|---:|---:|---:|")
    for kind in args.kinds:
        for n in args.envs:
            ours, hand = (instructions(loop, kind, n, args.steps) for loop in LOOPS)
            print(f"| {n} | {kind} | {ours:,.0f} | {hand:,.0f} | {ours - hand:+,.0f} | {ours / hand:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
