"""Greedy evaluation on separate envs: what it reports, what it stops, what it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from components.envs import GymEnvFactory, probe_env_spec
from components.models import ActorCritic
from pipeline.runner.evaluation import EvaluationError, Evaluator
from tests.conftest import run_pipeline
from tests.fakes import FaultyEnvFactory, SlowEnvFactory


def test_an_evaluation_plays_whole_greedy_episodes_with_the_given_weights():
    factory = GymEnvFactory("CartPole-v1")
    model = ActorCritic(probe_env_spec(factory), hidden=(8,))
    # 2 ms a step: the first evaluation is still running when the second start comes (fast episodes could end
    # in between, and the second start then began an evaluation of its own)
    evaluator = Evaluator(SlowEnvFactory(0.002), model, episodes=4, seed=1)
    try:
        assert evaluator.start(model.state_dict(), version=7, frames=100)
        assert not evaluator.start(model.state_dict(), version=8, frames=200) or not evaluator.busy
        evaluator.wait(60)
        result = evaluator.poll()
        assert result["episodes"] == 4 and result["policy_version"] == 7 and result["frames"] == 100
        assert result["return_mean"] == result["length_mean"] > 0, "CartPole: return = length"
        assert evaluator.poll() is None, "each result once"
        # the same weights and seeds play the same greedy episodes
        evaluator.start(model.state_dict(), version=7, frames=100)
        evaluator.wait(60)
        again = evaluator.poll()
        assert again["return_mean"] > 0
    finally:
        evaluator.close()


def test_snapshots_are_copies_not_views_of_the_trainers_weights():
    factory = GymEnvFactory("CartPole-v1")
    model = ActorCritic(probe_env_spec(factory), hidden=(8,))
    evaluator = Evaluator(factory, model, episodes=1, seed=1)
    weights = model.state_dict()
    try:
        evaluator.start(weights, version=1, frames=1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)  # the trainer moves on while the evaluation runs
        evaluator.wait(60)
        assert not torch.equal(evaluator.model.actor[-1].weight, model.actor[-1].weight)
    finally:
        evaluator.close()


def test_a_failing_eval_env_is_one_clear_error():
    factory = FaultyEnvFactory(at_step=3, fault="raise")
    evaluator = Evaluator(factory, ActorCritic(probe_env_spec(GymEnvFactory("CartPole-v1")), hidden=(8,)), episodes=2)
    try:
        evaluator.start(evaluator.model.state_dict(), version=0, frames=0)
        evaluator.wait(60)
        with pytest.raises(EvaluationError, match="evaluation failed: RuntimeError: boom at step 3"):
            evaluator.poll()
    finally:
        evaluator.close()


@pytest.mark.slow
def test_a_run_logs_eval_returns_and_can_stop_on_them(tmp_path):
    run_dir = tmp_path / "eval"
    result = run_pipeline(["eval.interval=2000", "eval.episodes=3", "trainer.target_metric=eval",
                           "trainer.target_return=60", "trainer.total_frames=60000", "logger=jsonl",
                           "logger.interval=0.3", "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/return_mean"] for r in rows[:-1] if "eval/return_mean" in r]
    summary = rows[-1]["summary"]
    # the greedy return that stopped the run reached the target; the summary then holds the final
    # weights' own evaluation (a later version, evaluated on other episodes: it may fall short)
    assert evals and max(evals) >= 60 and summary["stop_reason"] == "target_return"
    assert "eval/return_mean" in summary and summary["eval/policy_version"] >= 1
    assert summary["frames"] < 60000


def test_target_metric_eval_needs_an_eval_interval(tmp_path):
    result = run_pipeline(["trainer.target_metric=eval", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert result.returncode == 2
    assert "trainer.target_metric='eval': needs eval.interval" in result.stderr


def test_the_deprecated_trainer_keys_still_evaluate_with_one_note_each(tmp_path):
    run_dir = tmp_path / "old"
    result = run_pipeline(["trainer.eval_interval=1024", "trainer.eval_episodes=2", "trainer.total_frames=2048",
                           "trainer.target_return=null", "logger=jsonl", "progress=false", f"hydra.run.dir={run_dir}"],
                          cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stderr.splitlines() if "is deprecated" in line]
    assert notes == ["note: trainer.eval_interval is deprecated and will be removed: use eval.interval",
                     "note: trainer.eval_episodes is deprecated and will be removed: use eval.episodes"]
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["eval/episodes"] == 2.0
