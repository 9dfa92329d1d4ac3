"""deterministic=true: two runs of one config write the same rows and the same weights (end to end)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.runner.reproducibility import timing_column
from tests.conftest import ROOT, run_pipeline

COMMON = ["seed=3", "trainer.target_return=null", "deterministic=true", "logger=jsonl", "progress=false",
          "checkpoint.interval=null"]
SMALL_SAC = ["trainer.total_frames=3072", "trainer.learning_starts=512", "model.hidden=[32,32]",
             "trainer.critic_hidden=[32,32]", "trainer.updates_per_frame=0.5", "torch_threads=1"]
CASES = {
    "ppo-thread-workers": ["trainer.total_frames=6144", "workers=thread"],
    "ppo-process-workers-process-server": ["trainer.total_frames=6144", "workers=process", "server=process",
                                           "transport=slots", "env.envs_per_worker=4"],
    "ppo-process-workers-inline-policy": ["trainer.total_frames=6144", "workers=process", "server=inline",
                                          "env.envs_per_worker=4"],
    # an LSTM (env=no_velocity's preset): states carried through lockstep batches, the evaluation's from zero
    "ppo-lstm-process-workers-process-server": ["env=no_velocity", "trainer.total_frames=4096", "workers=process",
                                                "server=process", "transport=slots", "env.envs_per_worker=4",
                                                "eval.interval=2048", "eval.episodes=2"],
    "dqn-thread-workers": ["trainer=dqn", "replay=uniform", "trainer.total_frames=4096",
                           "trainer.learning_starts=512", "trainer.updates_per_batch=8", "workers=thread"],
    # greedy evaluation every 2048 frames: its rows are the same too
    "dqn-process-workers-process-server": ["trainer=dqn", "replay=uniform", "trainer.total_frames=4096",
                                           "trainer.learning_starts=512", "trainer.updates_per_batch=8",
                                           "eval.interval=2048", "eval.episodes=2",
                                           "workers=process", "server=process", "transport=slots"],
    # SAC on Pendulum with small networks: the actor's sampling noise per env, replay sampling, the updates owed
    "sac-thread-workers": ["env=classic", "trainer=sac", *SMALL_SAC, "workers=thread"],
}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without_timing(row: dict) -> dict:
    if "summary" in row:
        return {"summary": _without_timing(row["summary"])}
    return {key: value for key, value in row.items() if not timing_column(key)}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]


@pytest.mark.parametrize("case", list(CASES))
def test_two_deterministic_runs_write_the_same_rows_and_weights(case, tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for run_dir in dirs:
        proc = run_pipeline([*COMMON, *CASES[case], f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=240)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "mode      deterministic:" in proc.stdout
    first, second = (_rows(d) for d in dirs)
    assert len(first) >= 10 and len(first) == len(second)
    assert [r.get("collector/frames") for r in first] == [r.get("collector/frames") for r in second]
    for i, (a, b) in enumerate(zip(first, second)):
        assert _without_timing(a) == _without_timing(b), f"row {i} differs"
    summary = first[-1]["summary"]
    assert summary["mode"] == "deterministic" and len(summary["config_hash"]) == 16
    assert summary["config_hash"] == second[-1]["summary"]["config_hash"]
    if "eval.interval" in " ".join(CASES[case]):
        assert any("eval/return_mean" in r for r in first), "the evaluations were logged"
    if "dqn" in case or "sac" in case:
        assert any("train/loss" in r or "train/q_loss" in r for r in first), "it learned"
    else:
        assert all(r["collector/policy_lag_max"] == 0 for r in first if "collector/policy_lag_max" in r)
    wa, wb = (_weights(d) for d in dirs)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "the final weights differ"


def test_the_default_mode_is_async_and_its_summary_says_so(tmp_path):
    proc = run_pipeline(["trainer.total_frames=1024", "trainer.target_return=null", "logger=jsonl", "progress=false",
                         f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mode      " not in proc.stdout
    summary = _rows(tmp_path / "run")[-1]["summary"]
    assert summary["mode"] == "async" and len(summary["config_hash"]) == 16


@pytest.mark.parametrize("args, message", [
    (["workers=ray"], "deterministic=true: not available with workers=ray"),
    (["trainer.frames_per_batch=250"], "deterministic=true: frames_per_batch=250 is not a multiple of num_envs=8"),
])
def test_what_deterministic_cannot_do_is_one_line(args, message, tmp_path):
    proc = run_pipeline(["deterministic=true", *args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"config error: {proc.stderr.split('config error: ')[1].strip()}"]
    assert message in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_timing_columns_are_the_clocks_not_the_learning():
    for key in ("time", "train/update_ms", "collector/frames_per_s", "server/interval_s", "eval/seconds",
                "collector/worker0/env_frac", "collector/bound", "collector/policy_version"):
        assert timing_column(key), key
    for key in ("train/clip_fraction", "train/policy_loss", "episode/return_mean", "server/rows",
                "collector/rows_requested", "collector/frames", "eval/return_mean"):
        assert not timing_column(key), key


RESUMABLE = {
    "ppo-thread-workers": ["trainer.total_frames=18432", "workers=thread", "checkpoint.frames=6144"],
    "dqn-process-workers-process-server": ["trainer=dqn", "replay=uniform", "trainer.total_frames=4096",
                                           "trainer.learning_starts=512", "trainer.updates_per_batch=8",
                                           "eval.interval=1024", "eval.episodes=2",
                                           "workers=process", "server=process", "transport=slots",
                                           "checkpoint.frames=2048"],
    # the memory replay is in each checkpoint: the resumed run samples what the uninterrupted one did
    "sac-process-workers-process-server": ["env=classic", "trainer=sac", *SMALL_SAC[1:], "trainer.total_frames=2560",
                                           "workers=process", "server=process", "transport=slots",
                                           "checkpoint.frames=1024"],
}


def _kill_after_first_checkpoint(args: list[str], run_dir: Path, cwd: Path) -> None:
    """Start the run, SIGKILL its whole group a moment after its first checkpoint is on disk."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args, f"hydra.run.dir={run_dir}"], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoint.pt").exists():
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.01)
        time.sleep(0.2)  # into the next interval: rows after the checkpoint that the resume must rewind
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "killed, not finished"


@pytest.mark.parametrize("case", list(RESUMABLE))
def test_a_deterministic_run_killed_and_resumed_writes_the_rows_of_the_run_never_killed(case, tmp_path):
    args = [*COMMON, *RESUMABLE[case]]
    args.remove("checkpoint.interval=null")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = run_pipeline([*args, f"hydra.run.dir={whole}"], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _kill_after_first_checkpoint(args, killed, tmp_path)
    frames = torch.load(killed / "checkpoint.pt", weights_only=True)["frames"]
    assert 0 < frames < int(next(a for a in args if a.startswith("trainer.total_frames=")).split("=")[1])
    proc = run_pipeline([f"resume={killed}"], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = [[_without_timing(r) for r in _rows(d) if r.get("frames", float("inf")) > frames] for d in (whole, killed)]
    assert len(after[0]) >= 5 and len(after[0]) == len(after[1])
    for i, (a, b) in enumerate(zip(*after)):
        assert a == b, f"row {i} after the checkpoint at {frames} frames differs"
    wa, wb = (_weights(d) for d in (whole, killed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the final weights differ"
