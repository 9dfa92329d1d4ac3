"""``python -m pipeline.bench.ab --before DIR``: this checkout against another, alternating.

A regression check for a change: both trees run the same collector benchmark
contenders, one repeat per invocation, in alternating order (before, after,
after, before, ...), so drift of a shared machine hits both alike. Prints the
median frames/s of every contender per tree and the after/before ratio.

Example (the tree before a change, checked out next to this one)::

    git worktree add /tmp/before <commit>
    python -m pipeline.bench.ab --before /tmp/before --rounds 3 \\
        --contenders ours:process/slots/process/auto ours:thread/slots/thread/auto
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def run_once(tree: Path, workload: str, contenders: list[str], seconds: float, out: Path) -> dict[str, float]:
    """One repeat of ``contenders`` in ``tree``; frames/s per contender (missing: the trial failed)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    listed = "[" + ",".join(f'"{c}"' for c in contenders) + "]"
    subprocess.run(
        [sys.executable, "-m", "pipeline.bench", f"bench_workload={workload}", f"contenders={listed}", "repeats=1",
         f"seconds={seconds}", f"hydra.run.dir={out}"],
        cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600,
    )
    report = json.loads((out / f"bench_{workload}.json").read_text())
    return {t["contender"]: t["frames"] / t["seconds"] for t in report["trials"] if t.get("ok") and t.get("seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    parser.add_argument("--workload", default="cartpole", help="bench_workload: cartpole or pong")
    parser.add_argument("--contenders", nargs="+", default=["ours:process/slots/process/auto"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": HERE}
    fps: dict[str, dict[str, list[float]]] = {name: {c: [] for c in args.contenders} for name in trees}
    with tempfile.TemporaryDirectory(prefix="ab-bench-") as tmp:
        for round_ in range(args.rounds):
            order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
            for name in order:
                result = run_once(trees[name], args.workload, args.contenders, args.seconds,
                                  Path(tmp) / f"{name}-{round_}")
                for contender, value in result.items():
                    fps[name][contender].append(value)
                print(f"round {round_ + 1} {name}: " + ", ".join(f"{c} {v:,.0f}" for c, v in result.items()),
                      flush=True)
    print(f"\n{args.workload}: median frames/s over {args.rounds} rounds (min..max)")
    print("| contender | before | after | after / before |\n|---|---:|---:|---:|")
    for contender in args.contenders:
        b, a = fps["before"][contender], fps["after"][contender]
        if not a or not b:
            print(f"| {contender} | {'failed' if not b else f'{statistics.median(b):,.0f}'} | "
                  f"{'failed' if not a else f'{statistics.median(a):,.0f}'} | - |")
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        print(f"| {contender} | {mb:,.0f} ({min(b):,.0f}..{max(b):,.0f}) | {ma:,.0f} ({min(a):,.0f}..{max(a):,.0f}) "
              f"| {ma / mb:.2f} |")


if __name__ == "__main__":
    main()
