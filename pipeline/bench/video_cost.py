"""``python -m pipeline.bench.video_cost``: what evaluation (and its videos) costs collection.

Evaluation runs on envs of its own in a background thread of the driver,
and videos add rendering and encoding there. The question a user asks is
whether turning ``eval.video=true`` on slows training. This runs the same
``python -m pipeline`` job three ways (no evaluation; evaluation every
``--every`` frames; the same with videos), alternating the three in each
repeat so drift on the machine hits them alike, and prints for each the
median collection rate (frames over time at the last row logged while
training: the final evaluation, and the wait for its video, come after
collection ended and are not collection) with its ratio to the run without
videos, and the median wall time of the whole run (those included).

    python -m pipeline.bench.video_cost                      # CartPole, 100k frames, 3 repeats
    python -m pipeline.bench.video_cost --set env=atari --frames 20000 --every 5000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: contender -> the overrides it adds (``{every}`` is the evaluation interval)
CONTENDERS: dict[str, list[str]] = {
    "no-eval": [],
    "eval": ["eval.interval={every}", "eval.episodes=4"],
    "eval+video": ["eval.interval={every}", "eval.episodes=4", "eval.video=true", "eval.video_episodes=1"],
}


def run_once(name: str, overrides: list[str], frames: int, every: int, out: Path) -> tuple[float, float]:
    """One job; its collection frames/s and wall time (raises with the job's last error lines if it failed)."""
    run_dir = out / f"{name}-{len(list(out.glob(f'{name}-*')))}"
    extra = [o.format(every=every) for o in CONTENDERS[name]]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "pipeline", *overrides, *extra, f"trainer.total_frames={frames}",
                           "trainer.target_return=null", "logger=jsonl", "progress=false", "checkpoint.interval=null",
                           f"hydra.run.dir={run_dir}"], cwd=out, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = rows[-1]["summary"]
    training = [r for r in rows[:-2] if r.get("time")]  # rows[-2]: the final row, after the final evaluation
    last = training[-1] if training else rows[-2]
    return float(last["frames"]) / float(last["time"]), float(summary["wall_time_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench.video_cost", description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=100_000)
    p.add_argument("--every", type=int, default=10_000, help="frames between evaluations")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for every job")
    p.add_argument("--out", type=Path, default=Path("runs/bench-video"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    fps: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    wall: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for repeat in range(args.repeats):
        order = list(CONTENDERS) if repeat % 2 == 0 else list(reversed(CONTENDERS))
        for name in order:
            rate, seconds = run_once(name, list(args.set), args.frames, args.every, out)
            fps[name].append(rate)
            wall[name].append(seconds)
            print(f"  repeat {repeat} {name}: {rate:,.0f} frames/s collecting, {seconds:.1f} s in all", flush=True)
    base = statistics.median(fps["eval"])
    print(f"\n{args.frames:,} frames, an evaluation every {args.every:,}, medians of {args.repeats} "
          f"({' '.join(args.set) or 'CartPole defaults'}):")
    print("| run | collection frames/s (median) | runs | vs eval without video | wall s (median, all of the run) |\n"
          "|---|---:|---|---:|---:|")
    for name, values in fps.items():
        median = statistics.median(values)
        print(f"| {name} | {median:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | {median / base:.2f}x | "
              f"{statistics.median(wall[name]):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
