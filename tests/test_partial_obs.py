"""No-velocity envs: the same env, with only its position entries observed."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from components.partial_obs import KeepObservationEntries, NoVelocityEnvFactory, positions_of
from tests.conftest import run_pipeline


@pytest.mark.parametrize("env_id, kept", [("CartPole-v1", [0, 2]), ("Pendulum-v1", [0, 1])])
def test_the_observation_is_the_full_envs_without_its_velocities(env_id, kept):
    hidden, full = NoVelocityEnvFactory(env_id)(), gym.make(env_id)
    assert hidden.observation_space.shape == (len(kept),)
    a, _ = hidden.reset(seed=4)
    b, _ = full.reset(seed=4)
    full.action_space.seed(4)
    for _ in range(30):
        assert np.array_equal(a, b[kept])
        action = full.action_space.sample()
        a, ra, ta, ua, _ = hidden.step(action)
        b, rb, tb, ub, _ = full.step(action)
        assert (ra, ta, ua) == (rb, tb, ub)
        if ta or ua:
            a, _ = hidden.reset(seed=5)
            b, _ = full.reset(seed=5)


def test_unknown_envs_and_bad_entries_say_what_to_give():
    with pytest.raises(ValueError, match=r"no known velocities to hide in 'Taxi-v3'.*env.factory.keep"):
        positions_of("Taxi-v3")
    assert NoVelocityEnvFactory("CartPole-v1", keep=[1])().observation_space.shape == (1,)
    with pytest.raises(ValueError, match="distinct entries of an observation of 4"):
        KeepObservationEntries(gym.make("CartPole-v1"), [0, 7])


def test_env_no_velocity_trains_from_the_command_line(tmp_path):
    proc = run_pipeline(["env=no_velocity", "trainer.total_frames=2048", "trainer.target_return=null",
                         "logger=jsonl", "progress=false", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    bad = run_pipeline(["env=no_velocity", "env.id=Taxi-v4", f"hydra.run.dir={tmp_path / 'bad'}"], cwd=tmp_path)
    assert bad.returncode == 2 and "no known velocities to hide in 'Taxi-v4'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
