"""Every kind of process the pipeline starts holds the thread pools the plan gives it.

Each process writes what threadpoolctl sees and ``torch.get_num_threads()``
to ``$RLPIPELINE_POOLS_DIR`` (components/threads.py) once it has loaded what
it runs; these tests start each kind for real and read those reports. A
pool left at its default holds one thread per CPU, so on a 2-CPU machine a
size of 1 (or the 3 some tests ask for: set after loading, a size is not
capped at the CPU count) cannot be met by accident.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from components.threads import POOL_VARS, REPORT_DIR_VAR, child_pools, pin_pools, pools
from tests.conftest import ROOT, run_pipeline

FAST = ["trainer.total_frames=3000", "trainer.frames_per_batch=512", "env.num_envs=4", "trainer.target_return=null",
        "logger=jsonl", "progress=false"]


def _reports(where: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for path in sorted(where.glob("*.json")):
        data = json.loads(path.read_text())
        out.setdefault(re.sub(r"-\d+$", "", data["role"]), []).append(data)
    return out


def _assert_pools(report: dict, threads: int, started_pinned: bool = True) -> None:
    """Every BLAS/OpenMP library the process loaded, and torch, hold ``threads``; so would later ones.

    ``started_pinned``: a child the pipeline started (the driver is started by the user's shell).
    """
    libraries = report["libraries"]
    assert any(lib["user_api"] == "blas" for lib in libraries), report  # numpy's OpenBLAS at least
    for lib in libraries:
        assert lib["num_threads"] == threads, (report["role"], lib)
    assert report["torch"] == threads, report
    assert all(value == str(threads) for value in report["env"].values()), report
    if started_pinned and report["start_env"] is not None:  # Linux: sized at the start, before numpy or torch could load
        assert all(value == str(threads) for value in report["start_env"].values()), report


def _threads_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.strip().startswith("threads "))


def test_process_workers_server_process_and_sinks_hold_what_the_plan_prints(tmp_path):
    where = tmp_path / "pools"
    done = run_pipeline([*FAST, "logger=tensorboard", "workers=process", "transport=slots", "server=process",
                         "server.num_threads=3", "torch_threads=3", f"hydra.run.dir={tmp_path / 'run'}"],
                        cwd=tmp_path, env={REPORT_DIR_VAR: str(where)})
    assert done.returncode == 0, done.stderr[-3000:]
    line = _threads_line(done.stdout)
    assert "driver 3" in line and "env worker process(es) 1 each" in line and "inference process 3" in line, line
    assert "metric sinks 1" in line, line
    reports = _reports(where)
    workers = [r for role, rs in reports.items() if role.startswith("env-worker") for r in rs]
    assert workers, reports.keys()
    for report in workers:
        _assert_pools(report, 1)
    _assert_pools(reports["infer-server"][0], 3)
    _assert_pools(reports["metric-sinks"][0], 1)
    _assert_pools(reports["driver"][0], 3, started_pinned=False)


def test_inline_workers_get_their_policy_copy_threads(tmp_path):
    where = tmp_path / "pools"
    done = run_pipeline([*FAST, "workers=process", "server=inline", "server.num_threads=3", "server.engine=torch",
                         f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env={REPORT_DIR_VAR: str(where)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "env worker process(es) 3 each" in _threads_line(done.stdout)
    reports = _reports(where)
    workers = [r for role, rs in reports.items() if role.startswith("env-worker") for r in rs]
    assert workers, reports.keys()
    for report in workers:
        _assert_pools(report, 3)
    _assert_pools(reports["driver"][0], 1, started_pinned=False)
    assert "infer-server" not in reports


def test_a_replaced_worker_is_pinned_like_the_first(tmp_path):
    """A worker started again after a crash goes through the same start: its pools hold the plan's size."""
    from components.collector.collector import AsyncBatchedCollector
    from components.collector.graph import GraphSpec
    from components.inference.loop import ServerConfig
    from components.models import ModelSpec
    from tests.fakes import ExplodingEnvFactory

    where = tmp_path / "pools"
    os.environ[REPORT_DIR_VAR] = str(where)
    try:
        collector = AsyncBatchedCollector(
            ExplodingEnvFactory(at_step=30), ModelSpec("components.models.ActorCritic", {"hidden": [8]}),
            GraphSpec("process", "process", num_envs=2, envs_per_worker=2, chunk_len=4),
            frames_per_batch=64, total_frames=-1, seed=0, max_restarts=10,
            server_config=ServerConfig(max_batch_size=2, num_threads=1))
        try:
            collector.start()
            for _ in range(3):  # 96 steps per env: its envs raise at step 30, 60 and 90
                collector.next_batch()
        finally:
            collector.shutdown()
    finally:
        os.environ.pop(REPORT_DIR_VAR, None)
    workers = [r for role, rs in _reports(where).items() if role.startswith("env-worker") for r in rs]
    assert len(workers) >= 2, "the worker was not replaced"
    for report in workers:
        _assert_pools(report, 1)


def test_bench_trials_and_bare_loops_are_pinned(tmp_path, monkeypatch):
    from pipeline.bench.harness import run_trial

    where = tmp_path / "pools"
    monkeypatch.setenv(REPORT_DIR_VAR, str(where))
    workload = {"name": "cartpole", "overrides": ["env=cartpole", "model.hidden=[8]"], "num_envs": 4,
                "frames_per_batch": 256, "device": "cpu"}
    for contender in ("bare_procs", "gym_sync"):
        got = run_trial({"contender": contender, "workload": workload, "num_envs": 4, "warmup": 0.1,
                         "seconds": 0.2}, timeout=120)
        assert got["ok"], got
    reports = _reports(where)
    assert len(reports["bench-trial"]) == 2 and len(reports["bare"]) == 2, reports.keys()
    for report in reports["bench-trial"] + reports["bare"]:
        _assert_pools(report, 1)


def test_child_pools_sets_the_sizes_only_for_children_started_inside():
    before = {var: os.environ.get(var) for var in POOL_VARS}
    with child_pools(1):  # a runtime caps what it reads at the CPU count: 1 is below every default
        assert all(os.environ[var] == "1" for var in POOL_VARS)
        code = ("import numpy, threadpoolctl, torch; "
                "print([l['num_threads'] for l in threadpoolctl.threadpool_info()], torch.get_num_threads())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=ROOT).stdout.strip()
    assert {var: os.environ.get(var) for var in POOL_VARS} == before
    sizes, torch_threads = out.rsplit(" ", 1)
    assert set(json.loads(sizes)) == {1} and torch_threads == "1", out
    with pytest.raises(ValueError):
        with child_pools(0):
            pass


def test_pin_pools_resizes_what_is_loaded_already():
    code = ("import numpy, torch; from components.threads import pin_pools, pools; pin_pools(3, torch_threads=2); "
            "p = pools(); print(sorted({l['num_threads'] for l in p['libraries'] if l['user_api'] == 'blas'}), "
            "p['torch'])")
    env = {k: v for k, v in os.environ.items() if k not in POOL_VARS}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[3]", "2"], out.stdout
    assert pools()["libraries"]  # this process: threadpoolctl sees numpy's BLAS
    with pytest.raises(ValueError):
        pin_pools(0)
