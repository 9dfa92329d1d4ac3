"""Resume: the command line replayed, metrics rewound, a checkpoint that loads without pickled classes."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from components.episodes import EpisodeTracker
from components.envs import EnvSpec
from components.models import ActorCritic, ModelSpec
from components.replay.storage import TensorStorage
from components.trainers.ppo import PPOConfig, PPOTrainer
from pipeline.runner.resume import resume_argv, rewind_metrics
from pipeline.runner.state import load_run_state, restore_episodes, rng_state, run_state, save_run_state, set_rng_state
from pipeline.plan.validate import ConfigError


def write_run_checkpoint(run_dir, frames: int = 640):  # noqa: ANN001, ANN201
    """A real run's ``checkpoint.pt`` (a small PPO trainer's state) in ``run_dir``."""
    spec = EnvSpec((4,), "float32", "discrete", action_n=2)
    trainer = PPOTrainer(ActorCritic(spec), PPOConfig(total_frames=1000))
    state = run_state(trainer=trainer, frames=frames, config={"seed": 0},
                      model_spec=ModelSpec("components.models.ActorCritic"), env_spec=spec,
                      tracker=EpisodeTracker(3), stop_reason="checkpoint", wandb_id=None)
    return save_run_state(run_dir / "checkpoint.pt", state)


def saved_run(tmp_path, overrides: list[str], name: str = "run", checkpoint: bool = True):  # noqa: ANN001, ANN201
    """A run directory as a run leaves it: ``.hydra/overrides.yaml`` (a YAML list) and a checkpoint."""
    import yaml

    run_dir = tmp_path / name
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    if checkpoint:
        write_run_checkpoint(run_dir)
    return run_dir


_saved_run = saved_run


def test_resume_replays_the_saved_overrides_and_applies_new_ones_on_top(tmp_path):
    run_dir = _saved_run(tmp_path, ["env=atari", "trainer.total_frames=1000", "seed=3", f"hydra.run.dir={tmp_path}/x"])
    argv = resume_argv([f"resume={run_dir}", "trainer.total_frames=5000", "progress=false"])
    quoted = f"'{run_dir.resolve()}'"
    assert argv == ["env=atari", "trainer.total_frames=5000", "seed=3", "progress=false",
                    f"resume={quoted}", f"hydra.run.dir={quoted}"]
    assert resume_argv(["seed=1"]) == ["seed=1"]


def test_resume_of_nothing_or_with_a_sweep_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no run to resume there"):
        resume_argv([f"resume={tmp_path / 'none'}"])
    run_dir = _saved_run(tmp_path, [], checkpoint=False)
    with pytest.raises(ConfigError, match="cannot be combined with -m"):
        resume_argv(["-m", f"resume={run_dir}", "seed=1,2"])


def test_rewinding_metrics_drops_later_rows_summaries_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"frames": f} for f in (100, 200, 300, 400)] + [{"summary": {"frames": 400}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"frames": 5')
    assert rewind_metrics(path, 250) == 2
    assert [json.loads(line)["frames"] for line in path.read_text().splitlines()] == [100, 200]


def test_a_checkpoint_loads_with_weights_only_and_restores_counters_rng_and_episodes(tmp_path):
    spec = EnvSpec((4,), "float32", "discrete", action_n=2)
    trainer = PPOTrainer(ActorCritic(spec), PPOConfig(total_frames=1000), policy_version=5)
    tracker = EpisodeTracker(3)
    tracker.add([10.0, 20.0, 30.0, 40.0], [1, 2, 3, 4])
    torch.manual_seed(11)
    np.random.seed(12)
    rng = rng_state()
    expected = (torch.rand(3), np.random.rand(3))
    state = run_state(trainer=trainer, frames=640, config={"seed": 0}, model_spec=ModelSpec("components.models.ActorCritic"),
                      env_spec=spec, tracker=tracker, stop_reason="checkpoint", wandb_id="abc123")
    path = save_run_state(tmp_path / "checkpoint.pt", state)
    loaded = load_run_state(path)  # weights_only=True: no class is unpickled
    assert loaded["frames"] == 640 and loaded["policy_version"] == 5 and loaded["wandb_id"] == "abc123"
    resumed = PPOTrainer(ActorCritic(spec), PPOConfig(total_frames=1000))
    resumed.load_state_dict(loaded)
    assert resumed.policy_version == 5
    fresh = EpisodeTracker(3)
    restore_episodes(fresh, loaded["episodes"])
    assert list(fresh.returns) == [20.0, 30.0, 40.0] and fresh.total == 4
    set_rng_state(rng)
    assert torch.equal(torch.rand(3), expected[0]) and np.array_equal(np.random.rand(3), expected[1])


def test_a_full_disk_is_an_error_when_a_disk_replay_is_created_not_a_sigbus_later(tmp_path, monkeypatch):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    storage = TensorStorage(1000, path=tmp_path / "replay")
    with pytest.raises(OSError, match="cannot reserve .* GB for .*No space left on device"):
        storage.extend(TensorDict({"x": torch.zeros(4, 8)}, [4]))
