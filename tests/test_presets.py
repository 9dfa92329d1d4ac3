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
    (["env=toy_text"], {"trainer.frames_per_batch": 2048, "trainer.ent_coef": 0.01, "trainer.gamma": 0.99,
                        "trainer.target_return": 7.0, "env.num_envs": 16, "env.id": "Taxi-v4"}),
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


def _box2d_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("Box2D") is not None


def test_env_gym_with_a_family_id_composes_as_the_family_option():
    """A user names the env: env=gym env.id=LunarLander-v3 gets what env=box2d sets (16 envs, the Box2D preset)."""
    from omegaconf import OmegaConf

    from pipeline.plan.presets import env_option_for, with_env_option

    as_gym = compose("env=gym", "env.id=LunarLander-v3", "trainer.lr=0.001")
    as_family = compose("env=box2d", "env.id=LunarLander-v3", "trainer.lr=0.001")
    assert OmegaConf.to_container(as_gym) == OmegaConf.to_container(as_family)
    assert (as_gym.env.num_envs, as_gym.trainer.target_return, as_gym.trainer.lr) == (16, 200.0, 0.001)
    assert compose("env=gym", "env.id=Acrobot-v1").env.name == "gym", "a family without its own option stays"
    assert env_option_for({"env": "gym"}, "HalfCheetah-v5") == "mujoco"
    assert env_option_for({"env": "box2d"}, "LunarLander-v3") is None, "only the generic option is re-chosen"
    assert with_env_option(["env=gym", "env.id=X", "seed=2"], "box2d") == ["env=box2d", "env.id=X", "seed=2"]
    assert with_env_option(["env.id=X"], "box2d") == ["env.id=X", "env=box2d"]
    rechosen = preset_choice({"specialize": "ppo_box2d", "trainer": "ppo", "env": "box2d"}, "LunarLander-v3",
                             rechosen="box2d")
    assert render.preset(rechosen).endswith("(LunarLander-v3 is a box2d env, so env=gym runs as env=box2d)")
    without = preset_choice({"specialize": "dqn_mujoco", "trainer": "dqn", "env": "mujoco"}, "Hopper-v5",
                            rechosen="mujoco")
    assert without.code == "family_without_preset"
    assert render.preset(without) == ("none for trainer=dqn: Hopper-v5 is a mujoco env, so env=gym runs as "
                                      "env=mujoco, which has no dqn preset")


@pytest.mark.skipif(not _box2d_installed(), reason="the box2d extra is not installed")
def test_a_run_of_env_gym_with_lunarlander_says_it_ran_as_env_box2d(tmp_path):
    from tests.conftest import run_pipeline

    run_dir = tmp_path / "run"
    proc = run_pipeline(["env=gym", "env.id=LunarLander-v3", "trainer.frames_per_batch=256", "trainer.minibatches=4",
                         "trainer.total_frames=512", "logger=jsonl", "workers=thread", f"hydra.run.dir={run_dir}"],
                        tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "specialize/ppo_box2d.yaml" in proc.stdout and "so env=gym runs as env=box2d" in proc.stdout
    saved = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "name: box2d" in saved and "gamma: 0.999" in saved


@pytest.mark.parametrize(("overrides", "target"), [
    # a preset's target is its own env's: another id of the family takes its registry reward_threshold
    (["env=gym", "env.id=MountainCarContinuous-v0"], 90.0),  # was Pendulum's -200: a false "solved" at -36.6
    (["env=gym", "env.id=BipedalWalker-v3"], 300.0),  # was LunarLander's 200
    (["env=gym", "env.id=FrozenLake-v1"], 0.7),  # was Taxi's 7.0: never reached
    (["env=gym", "env.id=CliffWalking-v1"], None),  # no threshold: the run goes to total_frames
    (["env=gym", "env.id=Acrobot-v1"], -100.0),  # no preset: the trainers' default is CartPole-v1's 475
    (["env=gym", "env.id=Acrobot-v1", "trainer=dqn"], -100.0),
    # the env a target was measured on keeps it, and so does a target the user set
    (["env=classic"], -200.0), (["env=box2d"], 200.0), (["env=toy_text"], 7.0), ([], 475.0),
    (["env=gym", "env.id=MountainCarContinuous-v0", "trainer.target_return=5"], 5.0),
    (["env=gym", "env.id=BipedalWalker-v3", "trainer.target_return=null"], None),
    (["env=mujoco"], None),  # a preset without a target stays without one
])
def test_a_presets_target_return_is_its_own_envs_and_another_id_takes_its_registry_threshold(overrides, target):
    assert compose(*overrides).trainer.target_return == target


def test_the_plan_says_where_the_target_came_from(tmp_path):
    from tests.conftest import run_pipeline

    run_dir = tmp_path / "run"
    proc = run_pipeline(["env=gym", "env.id=MountainCarContinuous-v0", "trainer.total_frames=8192", "logger=jsonl",
                         f"hydra.run.dir={run_dir}"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("target_return 90, MountainCarContinuous-v0's reward_threshold in gymnasium's registry "
            "(the -200 is Pendulum-v1's)") in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("total_frames: 8192 frames"), "not a false 'solved'"
    none = render.preset(preset_line_for(["env=gym", "env.id=CliffWalking-v1"]))
    assert none.endswith("target_return null: CliffWalking-v1 has no reward_threshold in gymnasium's registry, "
                         "the run goes to total_frames (the 7 is Taxi-v4's)"), none


def preset_line_for(overrides: list[str]):
    """The runner's preset line for ``overrides`` (composed with Hydra's choices, as the runner has them)."""
    from pipeline.plan.inputs import compose as compose_with
    from pipeline.plan.presets import preset_line

    cfg = compose_with([*overrides, "trainer.target_return=7.0"], with_hydra=True)  # the preset's, as if not adapted
    choices = dict(cfg.hydra.runtime.choices)
    return preset_line(cfg, overrides, choices)
