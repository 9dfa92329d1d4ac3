"""``python -m pipeline.bench.sweep``: a sweep with the basic launcher against the same sweep with joblib.

Runs ``python -m pipeline -m seed=0,...`` with Hydra's basic launcher (one
job after another: each job alone on the machine, its "solo" speed) and
with ``hydra/launcher=joblib hydra.launcher.n_jobs=N``, alternating, each
``--repeats`` times, and prints the sweeps' wall times (median and ratio)
and every job's collector frames/s against its solo median, so both claims
can be read off: the parallel sweep finishes sooner, and no job runs below
half its solo speed.

    python -m pipeline.bench.sweep                       # 4 seeds x 20,000 frames, n_jobs=2, 2 repeats
    python -m pipeline.bench.sweep --seeds 4 --frames 20000 --n-jobs 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _sweep(launcher: list[str], seeds: int, frames: int, workdir: Path) -> tuple[float, list[float], int]:
    sweep_dir = workdir / f"sweep-{time.monotonic_ns()}"
    args = [sys.executable, "-m", "pipeline", "-m", *launcher, "seed=" + ",".join(map(str, range(seeds))),
            f"trainer.total_frames={frames}", "logger=jsonl", "progress=false", f"hydra.sweep.dir={sweep_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    done = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - started
    fps = []
    for job in range(seeds):
        rows = (sweep_dir / str(job) / "metrics.jsonl").read_text().splitlines()
        fps.append(float(json.loads(rows[-1])["summary"]["collector/frames_per_s"]))
    return wall, fps, done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--frames", type=int, default=20000)
    parser.add_argument("--n-jobs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    contenders = {"basic": [], "joblib": ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.n_jobs}"]}
    walls: dict[str, list[float]] = {name: [] for name in contenders}
    fps: dict[str, list[list[float]]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        for r in range(args.repeats):
            for name, launcher in contenders.items():
                wall, job_fps, code = _sweep(launcher, args.seeds, args.frames, Path(tmp))
                if code != 0:
                    print(f"error: the {name} sweep exited with {code}", file=sys.stderr)
                    return 1
                walls[name].append(wall)
                fps[name].append(job_fps)
                print(f"repeat {r + 1}: {name:<6} {wall:6.1f} s, job frames/s "
                      + ", ".join(f"{f:,.0f}" for f in job_fps), flush=True)
    solo = statistics.median(f for run in fps["basic"] for f in run)
    parallel = [f for run in fps["joblib"] for f in run]
    basic_wall, joblib_wall = statistics.median(walls["basic"]), statistics.median(walls["joblib"])
    print(f"\n{args.seeds} seeds x {args.frames:,} frames, joblib n_jobs={args.n_jobs}, {args.repeats} repeats "
          f"on {os.cpu_count()} CPUs")
    print("| launcher | sweep wall time (median) | job frames/s (median) | slowest job frames/s |")
    print("|---|---|---|---|")
    print(f"| basic (one job at a time: solo) | {basic_wall:.1f} s | {solo:,.0f} | "
          f"{min(f for run in fps['basic'] for f in run):,.0f} |")
    print(f"| joblib | {joblib_wall:.1f} s ({basic_wall / joblib_wall:.2f}x faster) | "
          f"{statistics.median(parallel):,.0f} | {min(parallel):,.0f} ({min(parallel) / solo:.0%} of solo) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
