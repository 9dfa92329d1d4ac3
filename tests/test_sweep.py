"""Sweeps: every point reports, a failed one never stops the others, parallel jobs share the CPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.runner.run import concurrent_jobs
from pipeline.runner.sweep import JobRecord, read_records, report, started, write_record
from tests.conftest import run_pipeline

SMALL = ["trainer.total_frames=1500", "trainer.target_return=null", "logger=jsonl", "progress=false"]


def _sweep_dir(tmp_path: Path) -> Path:
    return tmp_path / "sweep"


def test_the_report_marks_unfinished_jobs_failed_and_names_the_best(tmp_path):
    write_record(tmp_path, JobRecord(0, ["trainer.lr=0.001"], str(tmp_path / "0"), "finished", 0, 120.0))
    write_record(tmp_path, JobRecord(1, ["trainer.lr=0.01"], str(tmp_path / "1"), "finished", 0, 300.0))
    write_record(tmp_path, JobRecord(2, ["trainer.lr=0.1"], str(tmp_path / "2"), "failed", 1, None, "failed: boom"))
    started(tmp_path, 3, ["trainer.lr=1.0"], tmp_path / "3")  # its worker died before it could report
    text, failed = report(tmp_path, "episode/return_mean", "maximize", ["python", "-m", "pipeline"])
    assert failed == 2
    assert "best: job 1 (trainer.lr=0.01) with episode/return_mean=300" in text
    assert "  python -m pipeline trainer.lr=0.1\n" in text + "\n" and "  python -m pipeline trainer.lr=1.0" in text
    rows = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["finished", "finished", "failed", "failed"]
    assert rows[3]["reason"] == "the job ended without reporting (killed?)"
    _, failed = report(tmp_path, "wall_time_s", "minimize", ["python", "-m", "pipeline"])
    assert len(read_records(tmp_path)) == 4


@pytest.mark.parametrize(("launcher", "expected"), [
    ({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}, 1),
    ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 2}, 2),
    ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": -1}, 16),
    ({"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": -2}, 15),
    ({"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
      "array_parallelism": 256}, 16),
    ({"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"}, 1),
])
def test_concurrent_jobs_follow_the_launcher(launcher, expected):
    assert concurrent_jobs(OmegaConf.create({"launcher": launcher}), cpus=16) == expected


@pytest.mark.slow
def test_a_point_that_fails_at_run_time_is_reported_the_others_finish_and_the_sweep_exits_1(tmp_path):
    result = run_pipeline(["-m", "env=gym", "env.id=CartPole-v1,NoSuchEnv-v0,Acrobot-v1", *SMALL,
                           f"hydra.sweep.dir={_sweep_dir(tmp_path)}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    out = result.stdout
    assert "[sweep] job 1 failed: env=gym env.id=NoSuchEnv-v0" in out, out[-3000:]
    assert "[sweep] job 2 finished" in out, "the point after the failed one still ran"
    assert "1 of 3 point(s) failed; re-run only them with:" in out
    assert "  python -m pipeline env=gym env.id=NoSuchEnv-v0 trainer.total_frames=1500" in out
    rows = [json.loads(line) for line in (_sweep_dir(tmp_path) / "sweep.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["finished", "failed", "finished"]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_joblib_jobs_run_process_workers_each_sized_for_its_share(tmp_path):
    result = run_pipeline(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1", "workers=process",
                           *SMALL, f"hydra.sweep.dir={_sweep_dir(tmp_path)}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.count("2 sweep jobs run at once (hydra.launcher.n_jobs)") == 2
    rows = [json.loads(line) for line in (_sweep_dir(tmp_path) / "sweep.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["finished", "finished"]
    assert all(r["objective"] is not None for r in rows)


@pytest.mark.slow
def test_optuna_maximises_the_return_and_the_summary_names_the_best_trial(tmp_path):
    result = run_pipeline(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3",
                           "trainer.lr=tag(log, interval(1e-4, 3e-3))", *SMALL,
                           f"hydra.sweep.dir={_sweep_dir(tmp_path)}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "Directions: ['maximize']" in result.stdout + result.stderr
    rows = [json.loads(line) for line in (_sweep_dir(tmp_path) / "sweep.jsonl").read_text().splitlines()]
    best = max(rows, key=lambda r: r["objective"])
    assert f"best: job {best['num']} (" in result.stdout and len(rows) == 3


@pytest.mark.slow
def test_submitit_local_runs_every_point(tmp_path):
    result = run_pipeline(["-m", "hydra/launcher=submitit_local", "seed=0,1", *SMALL,
                           f"hydra.sweep.dir={_sweep_dir(tmp_path)}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = [json.loads(line) for line in (_sweep_dir(tmp_path) / "sweep.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["finished", "finished"]
