"""Env families, their presets (applied on their own, named in the plan) and their envs."""

from __future__ import annotations

import pytest

from components.envs import GymEnvFactory, probe_env_spec
from pipeline.plan import Machine
from pipeline.plan import render
from pipeline.plan.presets import family_of, preset_choice
from pipeline.plan.validate import validate
from tests.conftest import compose


@pytest.mark.parametrize(("overrides", "expected"), [
    (["env=mujoco"], {"trainer.frames_per_batch": 2048, "trainer.minibatches": 32, "trainer.epochs": 10,
                      "trainer.reward_scale": True, "model.obs_norm": True, "env.id": "HalfCheetah-v5"}),
    (["env=classic"], {"trainer.gamma": 0.9, "model.obs_norm": True, "env.id": "Pendulum-v1"}),
    (["env=box2d"], {"trainer.gamma": 0.999, "trainer.gae_lambda": 0.98, "trainer.minibatches": 256,
                     "trainer.target_return": 200.0, "env.num_envs": 16}),
    (["env=box2d", "trainer=dqn", "replay=uniform"], {"trainer.lr": 0.00063, "replay.capacity": 50000,
                                                      "model._target_": "components.models.QNetwork"}),
    (["env=mujoco", "trainer.lr=0.001"], {"trainer.lr": 0.001}),  # the command line still wins
])
def test_each_family_gets_its_preset(overrides, expected):
    cfg = compose(*overrides)
    for dotted, value in expected.items():
        node = cfg
        for part in dotted.split("."):
            node = node[part]
        assert node == value, dotted
    validate(cfg, cuda_available=False, check_env=False)


def test_the_plan_names_the_preset_or_the_env_option_that_would_apply_one():
    applied = preset_choice({"specialize": "ppo_mujoco", "trainer": "ppo", "env": "mujoco"}, "HalfCheetah-v5")
    assert (applied.value, applied.code) == ("ppo_mujoco", "applied")
    assert render.preset(applied).startswith(
        "specialize/ppo_mujoco.yaml: trainer=ppo on env=mujoco: CleanRL's ppo_continuous_action")
    available = preset_choice({"specialize": "ppo_gym", "trainer": "ppo", "env": "gym"}, "LunarLander-v3")
    assert available.code == "available" and available.facts["file"] == "ppo_box2d"
    assert render.preset(available) == (
        "none: LunarLander-v3 is a box2d env; env=box2d env.id=LunarLander-v3 applies specialize/ppo_box2d.yaml")
    assert preset_choice({"specialize": "ppo_cartpole", "trainer": "ppo", "env": "cartpole"}, "CartPole-v1") is None
    assert family_of("Pendulum-v1") == "classic" and family_of("NoSuchEnv-v0") is None


@pytest.mark.parametrize(("module", "env_id", "obs", "kind"), [
    ("Box2D", "LunarLander-v3", (8,), "discrete"),
    ("mujoco", "HalfCheetah-v5", (17,), "continuous"),
])
def test_the_family_envs_build_when_their_extra_is_installed(module, env_id, obs, kind):
    pytest.importorskip(module, reason=f"the {module.lower()} extra is not installed (scripts/setup.sh installs it)")
    spec = probe_env_spec(GymEnvFactory(env_id))
    assert spec.obs_shape == obs and spec.action_kind == kind
    assert Machine.detect().cpus >= 1


def test_mujoco_warnings_go_to_logging_not_to_a_file_in_the_working_directory(tmp_path):
    """MuJoCo's default hook appends to ./MUJOCO_LOG.TXT and prints on every env built."""
    pytest.importorskip("mujoco", reason="the mujoco extra is not installed (scripts/setup.sh installs it)")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("from components.envs import GymEnvFactory\n"
            "for _ in range(3):\n    GymEnvFactory('HalfCheetah-v5')().close()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()
    assert "settotalmass" not in done.stderr + done.stdout
