"""A run's default directory (and so its wandb run) says which env it stepped, not which config family composed it."""

from __future__ import annotations

import pytest

from pipeline.plan.run_name import ENV_LABEL_CHARS, env_label
from tests.conftest import ROOT, run_pipeline


@pytest.mark.parametrize(("factory_id", "target", "factories", "label"), [
    ("Acrobot-v1", "components.envs.GymEnvFactory", None, "Acrobot-v1"),
    ("ALE/Pong-v5", "components.envs.AtariEnvFactory", None, "ALE-Pong-v5"),
    ("my_pkg.envs:Grid-v0", "components.envs.GymEnvFactory", None, "my_pkg.envs-Grid-v0"),  # module:id form
    ("CartPole-v1", "components.partial_obs.NoVelocityEnvFactory", None, "NoVelocityEnv-CartPole-v1"),
    (None, "byo_example.PickEnvFactory", None, "PickEnv"),  # a user's factory under the default option
    (None, "pkg.mod:make_env", None, "make_env"),
    (None, "pkg.Factory", None, "Factory"),
    ("CartPole-v1", "components.envs.GymEnvFactory", [{"count": 2}], "envset"),
    ("../../etc", "components.envs.GymEnvFactory", None, "etc"),  # nothing that climbs out of runs/
    ("x" * 100, "components.envs.GymEnvFactory", None, "x" * ENV_LABEL_CHARS),
    (None, None, None, "env"),
])
def test_the_label_names_the_env_in_characters_safe_for_a_path(factory_id, target, factories, label):
    assert env_label(factory_id, target, factories) == label


def test_a_run_of_your_own_env_under_the_default_option_is_named_after_it(tmp_path):
    proc = run_pipeline(["env.factory._target_=byo_example.PickEnvFactory", "~env.factory.id",
                         "trainer.total_frames=512", "trainer.target_return=null", "logger=jsonl", "progress=false"],
                        tmp_path, timeout=180, env={"PYTHONPATH": str(ROOT / "docs" / "examples")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").glob("*/*")
    assert "_PickEnv_ppo_" in run_dir.name and (run_dir / "metrics.jsonl").exists()
