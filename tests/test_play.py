"""``python -m pipeline.play``: a finished run's final evaluation replayed, its videos, and bad inputs in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.video import read_mp4
from tests.conftest import ROOT, run_pipeline


def _play(args: list[str], cwd: Path, timeout: float = 180.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "pipeline.play", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("play")
    run_dir = base / "run"
    result = run_pipeline(["eval.interval=2048", "eval.episodes=3", "trainer.total_frames=6144",
                           "trainer.target_return=null", "logger=jsonl", "progress=false",
                           f"hydra.run.dir={run_dir}"], cwd=base)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]


def test_play_prints_the_returns_of_the_runs_own_final_evaluation(cartpole_run, tmp_path):
    result = _play([str(cartpole_run)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    episodes = re.findall(r"^episode (\d+): return ([\d.]+), length (\d+)$", result.stdout, re.M)
    assert len(episodes) == 3
    mean = float(re.search(r"^mean return ([\d.]+) over 3 episode\(s\) \(deterministic", result.stdout, re.M).group(1))
    summary = _summary(cartpole_run)
    assert mean == pytest.approx(summary["eval/return_mean"], abs=0.005)
    # the checkpoint file itself plays the same episodes
    again = _play([str(cartpole_run / "checkpoint.pt")], cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == result.stdout


def test_play_writes_a_video_of_every_episode(cartpole_run, tmp_path):
    out = tmp_path / "watch.mp4"
    result = _play([str(cartpole_run), "episodes=2", "max_steps=40", f"video={out}", "mode=random"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lengths = [int(n) for n in re.findall(r", length (\d+)", result.stdout)]
    frames = read_mp4(out)
    assert len(frames) == sum(lengths) + 2 and frames[0].shape == (400, 600, 3)  # each episode: its reset + steps


def test_a_run_made_before_the_eval_group_still_plays(cartpole_run, tmp_path):
    state = torch.load(cartpole_run / "checkpoint.pt", weights_only=True)
    state["config"].pop("eval")
    state["config"]["trainer"]["eval_episodes"] = 2
    old = tmp_path / "old"
    old.mkdir()
    torch.save(state, old / "checkpoint.pt")
    result = _play([str(old)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "over 2 episode(s)" in result.stdout


def test_bad_inputs_are_one_line_each(cartpole_run, tmp_path):
    state = torch.load(cartpole_run / "checkpoint.pt", weights_only=True)
    state["config"]["env"]["factory"]["_target_"] = "os.system"
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    torch.save(state, crafted / "checkpoint.pt")
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    cases = [
        ([str(tmp_path / "nowhere")], "no such run directory or checkpoint"),
        ([str(foreign)], "is not a run's checkpoint"),
        ([str(cartpole_run), "speed=2"], "speed: not an option of pipeline.play"),
        ([str(cartpole_run), f"video={tmp_path / 'a.gif'}"], "give a path ending in .mp4"),
        ([str(cartpole_run), "mode=best"], "unknown interaction mode 'best'"),
        ([str(crafted)], "refused what would run code that is not this project's: env.factory._target_=os.system"),
        ([str(cartpole_run), "env.id=Acrobot-v1"], "do not fit the model"),
    ]
    for args, message in cases:
        result = _play(args, cwd=tmp_path)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], (args, result.stderr)


def test_your_own_env_plays_once_restated_and_a_recurrent_model_is_the_projects_own(tmp_path):
    """A recurrent run of a Dict-observation env of the user's: the model plays as it is, the env once restated."""
    run_dir = tmp_path / "run"
    result = run_pipeline(["env.factory._target_=tests.fakes.TreeEnvFactory", "~env.factory.id", "+env.factory.mask=obs",
                           "model=lstm", "trainer.total_frames=2048", "trainer.target_return=null", "logger=jsonl",
                           "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    refused = _play([str(run_dir), "episodes=2"], cwd=tmp_path)
    restate = f"python -m pipeline.play {run_dir} env.factory._target_=tests.fakes.TreeEnvFactory"
    assert refused.returncode == 2 and refused.stderr.strip().endswith(restate), refused.stderr
    assert "RecurrentActorCritic" not in refused.stderr
    played = _play([str(run_dir), "episodes=2", "env.factory._target_=tests.fakes.TreeEnvFactory"], cwd=tmp_path)
    assert played.returncode == 0, played.stderr[-2000:]
    assert re.search(r"mean return [\d.]+ over 2 episode", played.stdout), played.stdout


def test_a_model_of_your_own_is_accepted_only_as_restated():
    from pipeline.play import PlayError, _vet

    config = {"env": {"factory": {"_target_": "components.envs.GymEnvFactory", "id": "CartPole-v1"}}}
    with pytest.raises(PlayError, match=r"model._target_=tests.fakes.TinyActorCritic; restate them on the command "
                                        r"line to accept them: python -m pipeline.play run model._target_="):
        _vet(config, "tests.fakes.TinyActorCritic", {}, set(), Path("run"))
    _vet(config, "tests.fakes.TinyActorCritic", {}, {"model._target_=tests.fakes.TinyActorCritic"}, Path("run"))
    with pytest.raises(PlayError, match="model._target_=tests.fakes.TinyActorCritic"):  # restating another is not it
        _vet(config, "tests.fakes.TinyActorCritic", {}, {"model._target_=tests.fakes.TreeReader"}, Path("run"))


@pytest.mark.slow
def test_play_records_atari_as_the_emulators_rgb_frames(tmp_path):
    run_dir = tmp_path / "pong"
    result = run_pipeline(["env=atari", "env.num_envs=2", "trainer.frames_per_batch=128", "trainer.total_frames=256",
                           "trainer.minibatches=2", "workers=thread", "logger=jsonl", "progress=false",
                           f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "pong.mp4"
    played = _play([str(run_dir), "episodes=1", "max_steps=30", f"video={out}"], cwd=tmp_path, timeout=300)
    assert played.returncode == 0, played.stderr
    frames = read_mp4(out)
    assert len(frames) == 31 and frames[0].shape == (210, 160, 3)
    assert frames[5][..., 0].astype(int).sum() != frames[5][..., 1].astype(int).sum(), "colour, not grey"


@pytest.mark.slow
def test_play_replays_a_dqn_runs_final_evaluation(tmp_path):
    run_dir = tmp_path / "dqn"
    result = run_pipeline(["trainer=dqn", "replay=uniform", "eval.interval=2048", "eval.episodes=2",
                           "trainer.total_frames=4096", "trainer.learning_starts=512", "trainer.target_return=null",
                           "logger=jsonl", "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    played = _play([str(run_dir)], cwd=tmp_path)
    assert played.returncode == 0, played.stderr
    mean = float(re.search(r"^mean return ([\d.]+) over 2 episode\(s\)", played.stdout, re.M).group(1))
    assert mean == pytest.approx(_summary(run_dir)["eval/return_mean"], abs=0.005)
