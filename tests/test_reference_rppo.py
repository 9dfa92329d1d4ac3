"""The recurrent reference runs on a no-velocity env and writes the rows the learning benchmark reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_recurrent_reference_runs_and_writes_rows_the_benchmark_reads(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pipeline.bench.reference_rppo", "--env-id", "CartPole-v1",
                           "--no-velocity", "1", "--total-frames", "4096", "--num-envs", "4", "--frames-per-batch",
                           "256", "--minibatches", "2", "--epochs", "2", "--eval-episodes", "2", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(isinstance(r.get("episode/return_mean"), (int, float)) for r in rows if "summary" not in r)
    summary = next(r["summary"] for r in rows if "summary" in r)
    assert isinstance(summary["wall_time_s"], float) and isinstance(summary["eval/return_mean"], float)
