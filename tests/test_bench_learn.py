"""The learning benchmark's parts: the same hyper-parameters for both implementations, what it reads from a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pipeline.bench.learn import SUITE, _compose, read_run, reference_args, reference_module
from tests.conftest import ROOT


def test_the_reference_gets_the_pipelines_hyper_parameters():
    cfg = _compose(SUITE["halfcheetah"].overrides)
    args = reference_args(cfg)
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--frames-per-batch"] == "2048" and flags["--minibatches"] == "32" and flags["--epochs"] == "10"
    assert flags["--lr"] == "0.0003" and flags["--normalize"] == "1" and flags["--num-envs"] == str(cfg.env.num_envs)
    cartpole = dict(zip(*(lambda a: (a[::2], a[1::2]))(reference_args(_compose([])))))
    assert cartpole["--normalize"] == "0" and cartpole["--gamma"] == "0.98"


def test_a_recurrent_case_runs_the_recurrent_reference_with_the_same_core_and_hidden_velocities():
    from pipeline.bench.learn import reference_module

    cfg = _compose(SUITE["cartpole_novel"].overrides)
    args = reference_args(cfg)
    assert reference_module(cfg) == "pipeline.bench.reference_rppo"
    assert args.count("--normalize") == 1
    flags = dict(zip(args[::2], args[1::2]))
    assert (flags["--rnn"], flags["--rnn-hidden"], flags["--no-velocity"]) == ("lstm", str(cfg.model.rnn_hidden), "1")
    assert flags["--normalize"] == str(int(cfg.model.obs_norm)) and flags["--activation"] == str(cfg.model.activation)
    feed_forward = _compose(SUITE["cartpole_novel_ff"].overrides)
    assert reference_module(feed_forward) == "pipeline.bench.reference_ppo" and "--rnn" not in reference_args(feed_forward)
    assert not SUITE["cartpole_novel_ff"].has_reference  # reference_ppo cannot hide velocities


def test_a_run_is_read_for_final_best_eval_and_the_first_frame_at_target(tmp_path):
    rows = [{"frames": 100, "time": 1.0, "episode/return_mean": 10.0},
            {"frames": 200, "time": 2.0, "episode/return_mean": 60.0},
            {"frames": 300, "time": 3.0, "episode/return_mean": 40.0},
            {"summary": {"episode/return_mean": 40.0, "eval/return_mean": 55.0, "wall_time_s": 3.5}}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"frames\": 4")
    got = read_run(tmp_path, target=50.0)
    assert got == {"final": 40.0, "best": 60.0, "eval": 55.0, "frames_to_target": 200, "time_to_target": 2.0,
                   "wall": 3.5, "updates": None}
    assert read_run(tmp_path, target=None)["frames_to_target"] is None


def test_the_reference_runs_and_writes_rows_the_report_reads(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pipeline.bench.reference_ppo", "--env-id", "CartPole-v1",
                           "--total-frames", "1024", "--num-envs", "4", "--frames-per-batch", "256", "--normalize", "0",
                           "--minibatches", "1", "--epochs", "2", "--eval-episodes", "2", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["summary"]["frames"] == 1024 and rows[-1]["summary"]["eval/return_mean"] > 0
    assert [r["frames"] for r in rows[:4]] == [256, 512, 768, 1024]


def test_the_sac_cases_run_the_sac_reference_with_the_pipelines_hyper_parameters():
    cfg = _compose(SUITE["pendulum_sac"].overrides)
    assert reference_module(cfg) == "pipeline.bench.reference_sac"
    args = reference_args(cfg)
    flags = dict(zip(args[::2], args[1::2]))
    t = cfg.trainer
    assert flags["--policy-lr"] == str(t.actor_lr) and flags["--q-lr"] == str(t.critic_lr)
    assert flags["--updates-per-frame"] == str(t.updates_per_frame) and flags["--learning-starts"] == str(t.learning_starts)
    assert flags["--policy-frequency"] == "1" and flags["--hidden"] == "256" and flags["--num-envs"] == str(cfg.env.num_envs)
    assert SUITE["halfcheetah_sac"].frames >= 100_000


def test_a_sac_reference_run_counts_its_updates_from_its_rows(tmp_path):
    rows = [{"frames": 100, "time": 1.0, "episode/return_mean": -900.0, "train/updates": 40},
            {"frames": 200, "time": 2.0, "episode/return_mean": -300.0, "train/updates": 140},
            {"summary": {"episode/return_mean": -300.0, "wall_time_s": 2.5}}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_run(tmp_path, target=None)["updates"] == 140


def test_the_sac_update_bench_times_both_learners_and_prints_their_ratio(capsys):
    from pipeline.bench.sac_update import main

    assert main(["--shapes", "3x1", "--threads", "1", "--hidden", "8", "--steps", "2", "--rounds", "2"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["3x1", "1"] and float(cells[2]) > 0 and float(cells[3]) > 0 and cells[4].endswith("x")
