"""``python -m pipeline`` as a user runs it: outputs, sweeps, Atari, Ctrl-C, SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, assert_group_gone, group_alive, run_pipeline, wait_for_training

pytestmark = pytest.mark.slow


def _rows(run_dir: Path) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "summary" not in r]
    summaries = [r["summary"] for r in lines if "summary" in r]
    assert len(summaries) == 1, "exactly one summary row, at the end"
    return rows, summaries[0]


def _wandb_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_short_run_writes_metrics_checkpoint_and_an_offline_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    result = run_pipeline(
        ["trainer.total_frames=3000", "trainer.target_return=null", "logger.interval=0.5",
         f"hydra.run.dir={run_dir}"], cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transport auto (measured) -> " in result.stdout and " predicted " in result.stdout
    assert re.search(r"^total_frames: 3000 frames in [\d.]+ s, mean return -?[\d.]+ over the last \d+ episodes; "
                     r"checkpoint \S+checkpoint\.pt$", result.stdout, re.M), result.stdout[-500:]
    rows, summary = _rows(run_dir)
    assert summary["frames"] == 3000 and summary["stop_reason"] == "total_frames"
    last = rows[-1]
    for key in ("train/policy_loss", "train/value_loss", "train/entropy", "train/approx_kl", "train/lr",
                "collector/frames_per_s", "collector/policy_lag_mean", "collector/env_frac",
                "server/avg_batch_size", "server/requests_per_s", "server/batches_per_s",
                "server/queue_latency_p95_ms", "server/forward_p50_ms", "server/policy_version",
                "episode/return_mean", "episode/length_mean"):
        assert key in last, key
    # the policy runs inline in each worker: one forward per block of that worker's envs
    per_worker = re.search(r"^  envs +8 in \d+ \w+ worker\(s\) of up to (\d+)$", result.stdout, re.M)
    assert per_worker, result.stdout[:1500]
    assert last["frames"] == 3000 and last["server/avg_batch_size"] == float(per_worker.group(1))
    assert all(r["collector/policy_lag_mean"] >= 0 for r in rows if "collector/policy_lag_mean" in r), \
        "lag is never negative: version 0 is the initial weights"
    assert sum(r["server/rows"] for r in rows) == last["server/rows_total"], "the rows are exact per interval"
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["frames"] == 3000 and checkpoint["policy_version"] == len(range(0, 3000, 256))
    assert set(checkpoint) >= {"model", "optimizer", "config", "model_spec"}
    assert checkpoint["config"]["trainer"]["total_frames"] == 3000
    assert _wandb_runs(run_dir), "an offline wandb run in the run directory"
    assert (run_dir / ".hydra" / "config.yaml").exists()


def test_a_run_that_ends_before_any_episode_says_so_instead_of_a_nan_return(tmp_path):
    # MountainCar's episodes last 200 steps; 8 envs x 64 steps end none of them
    result = run_pipeline(["env=gym", "env.id=MountainCar-v0", "trainer.total_frames=512", "trainer.frames_per_batch=256",
                           "trainer.target_return=null", "logger=jsonl", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("total_frames: 512 frames in ") and ", no episode ended yet; checkpoint " in last, last
    assert "nan" not in last


def test_a_sweep_gives_each_point_its_own_run_directory(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = run_pipeline(
        ["-m", "server.max_batch_size=4,16", "trainer.total_frames=5000", "progress=false",
         f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in runs] == ["0", "1"]
    assert (sweep_dir / "sweep.jsonl").read_text().count('"status": "finished"') == 2
    for run_dir, max_batch in zip(runs, (4, 16)):
        rows, summary = _rows(run_dir)
        assert summary["frames"] <= 5000 and rows
        served = [r["server/avg_batch_size"] for r in rows if "server/avg_batch_size" in r]
        assert served and max(served) <= max_batch
        assert _wandb_runs(run_dir)


def test_dqn_fills_replay_in_the_background_and_logs_replay_stats(tmp_path):
    run_dir = tmp_path / "dqn"
    result = run_pipeline(
        ["trainer=dqn", "replay=prioritized", "trainer.total_frames=3072", "trainer.learning_starts=512",
         "trainer.target_return=null", "logger=jsonl", "logger.interval=0.5", "progress=false",
         f"hydra.run.dir={run_dir}"], cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replay    prioritized" in result.stdout
    rows, summary = _rows(run_dir)
    assert summary["frames"] == 3072
    last = rows[-1]
    # 3-step returns: each of the 8 envs may still hold its last 2 steps in the n-step
    # window (fewer when its episode ended there: a terminal flushes the window)
    assert 3072 - 8 * (3 - 1) <= last["replay/size"] <= 3072 and last["replay/sampled"] > 0
    assert "train/loss" in last and "train/epsilon" in last
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert {"model", "target", "optimizer"} <= set(checkpoint) and checkpoint["policy_version"] > 0


def test_atari_dqn_keeps_its_disk_replay_in_the_run_directory(tmp_path):
    pytest.importorskip("ale_py")
    run_dir = tmp_path / "pong-dqn"
    result = run_pipeline(
        ["env=atari", "trainer=dqn", "replay=uniform", "replay.storage=disk", "replay.capacity=4096",
         "trainer.total_frames=1536", "trainer.learning_starts=768", "trainer.updates_per_batch=2",
         "env.num_envs=8", "logger=jsonl", "logger.interval=1", "progress=false", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "replay" / "frames.memmap").exists()
    rows, summary = _rows(run_dir)
    assert summary["frames"] == 1536
    frame = 84 * 84
    assert frame < rows[-1]["replay/frame_bytes_per_transition"] < 1.3 * frame, "about one frame per transition"
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert "replay" in checkpoint, "a disk replay's state is part of the checkpoint"


def test_atari_runs_with_batched_inference(tmp_path):
    pytest.importorskip("ale_py")
    run_dir = tmp_path / "pong"
    result = run_pipeline(
        ["env=atari", "transport=slots", "server=process", "trainer.total_frames=1024", "trainer.frames_per_batch=512",
         "trainer.epochs=1", "env.num_envs=8", "env.envs_per_worker=2", "logger=jsonl", "logger.interval=1", "progress=false",
         f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transport slots: every worker" in result.stdout
    rows, summary = _rows(run_dir)
    assert summary["frames"] == 1024
    assert max(r.get("server/avg_batch_size", 0) for r in rows) > 1


def _start(args: list[str], run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args, "trainer.total_frames=100000000", "trainer.target_return=null",
         "logger.interval=0.5", "progress=false", f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )


def test_ctrl_c_stops_cleanly_within_seconds_and_keeps_a_checkpoint(tmp_path):
    run_dir = tmp_path / "interrupted"
    proc = _start(["workers=process"], run_dir)
    wait_for_training(proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    sent = time.monotonic()
    proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 130
    assert_group_gone(proc.pid, within=5)
    _, summary = _rows(run_dir)
    assert summary["stop_reason"].startswith("interrupted")
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["frames"] > 0


def test_sigkill_of_the_runner_leaves_no_orphan_processes(tmp_path):
    proc = _start(["workers=process", "server=process", "transport=slots", "logger=jsonl"], tmp_path / "killed")
    wait_for_training(proc)
    children = [pid for pid in group_alive(proc.pid) if pid != proc.pid]
    assert len(children) >= 3, "worker and server processes are running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert_group_gone(proc.pid, within=5)


@pytest.mark.parametrize(("overrides", "trainer", "frames"), [
    (["workers=process"], "ppo", 6144),
    (["trainer=dqn", "replay=uniform", "trainer.learning_starts=512"], "dqn", 3072),
])
def test_the_policy_inline_in_the_workers_trains_with_every_trainer(tmp_path, overrides, trainer, frames):
    """server=inline: weights reach every worker's copy (versions advance), statistics keep the server's keys."""
    run_dir = tmp_path / trainer
    result = run_pipeline(["server=inline", *overrides, f"trainer.total_frames={frames}", "trainer.target_return=null",
                           "logger=jsonl",
                           "logger.interval=0.5", "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "transport none: server=inline" in result.stdout
    rows, summary = _rows(run_dir)
    assert summary["frames"] == frames
    assert rows[-1]["server/policy_version"] > 0 and rows[-1]["server/rows_total"] >= summary["frames"]
    assert rows[-1]["server/weight_updates_total"] > 1
    if trainer == "dqn":
        assert rows[-1]["train/epsilon"] < 1.0 and rows[-1]["replay/sampled"] > 0


def test_a_reader_that_stops_reading_stdout_does_not_end_the_run(tmp_path):
    """``python -m pipeline | head -3``: the run goes on quietly and finishes, nothing lost, no traceback."""
    run_dir = tmp_path / "piped"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "trainer.total_frames=8192", "trainer.target_return=null", "logger=jsonl",
         "logger.interval=0.2", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(3)]  # the plan's first lines, then the reader leaves
        proc.stdout.close()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert lines[0].startswith("plan:")
    assert proc.returncode == 0, err[-3000:]
    assert "BrokenPipeError" not in err and "Traceback" not in err, err[-3000:]
    _, summary = _rows(run_dir)
    assert summary["frames"] == 8192 and (run_dir / "checkpoint.pt").exists()


def test_envs_that_mostly_wait_train_with_concurrent_envs_chosen_by_measurement(tmp_path):
    """transport=auto probes a 2 ms step that computes for ~0.1 ms and lets every env step on its own."""
    run_dir = tmp_path / "waiting"
    result = run_pipeline(["~env.factory.id", "env.factory._target_=pipeline.bench.waiting_env.WaitingEnvFactory",
                           "+env.factory.mean_ms=2.0", "env.num_envs=16", "trainer.total_frames=4096",
                           "trainer.target_return=null", "logger=jsonl", "progress=false",
                           f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # Which of the two the model prefers depends on the machine's costs (GIL time per frame against the CPUs);
    # stepping the 16 envs one after another (a ~32 ms round) is never right.
    own_thread = "each env in its own thread" in result.stdout
    own_process = re.search(r"-> 16 process worker\(s\) of (up to )?1 envs", result.stdout) is not None
    assert own_thread or own_process, result.stdout
    rows, summary = _rows(run_dir)
    assert summary["frames"] == 4096
    assert rows[-1]["server/policy_version"] > 0, "the trainer's weights reached the policy that acted"


def test_a_closure_env_factory_trains_with_process_workers(tmp_path):
    """env.factory._target_ may name a function that returns a lambda: it reaches the workers by value."""
    run_dir = tmp_path / "run"
    proc = run_pipeline(["env.factory._target_=tests.fakes.closure_env_factory", "~env.factory.id",
                         "+env.factory.env_id=CartPole-v1", "workers=process",
                         "server=process", "trainer.total_frames=1024", "trainer.target_return=null", "logger=jsonl",
                         f"hydra.run.dir={run_dir}"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1 process worker(s)" in proc.stdout or "process worker(s)" in proc.stdout, proc.stdout[-2000:]
    _, summary = _rows(run_dir)
    assert summary["frames"] == 1024 and summary["stop_reason"] == "total_frames"
