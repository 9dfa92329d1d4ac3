"""Which hyper-parameter preset a run got, said in the plan.

Presets are ``conf/specialize/<trainer>_<env>.yaml`` files that Hydra
applies on their own when the pair matches (``env=mujoco`` with
``trainer=ppo`` gets ``ppo_mujoco.yaml``). Nothing shows that in the config
a user typed, so the plan names the file and the first line of what it
says; and when ``env=gym`` names an env of a family that has a preset, the
plan says which ``env=`` option would apply it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pipeline import CONF_DIR
from pipeline.plan.choice import Choice
from pipeline.plan.options import option_summary

#: env= option -> the gymnasium modules its envs come from
FAMILIES = {"box2d": ("gymnasium.envs.box2d",), "mujoco": ("gymnasium.envs.mujoco",),
            # continuous classic control only: CartPole and Acrobot keep the defaults
            "classic": ("gymnasium.envs.classic_control.pendulum",
                        "gymnasium.envs.classic_control.continuous_mountain_car")}


def _summary(path: Path) -> str:
    """The preset's description: its comment lines after the package line, as one sentence."""
    return option_summary(path, width=None)


def family_of(env_id: str) -> str | None:
    """``box2d``, ``mujoco`` or ``classic`` (continuous classic control) for a gymnasium id of those families."""
    try:
        import gymnasium as gym

        entry = str(gym.spec(env_id).entry_point)
    except Exception:  # noqa: BLE001 - an unknown id is the validator's business
        return None
    return next((name for name, modules in FAMILIES.items() if entry.startswith(modules)), None)


def preset_choice(choices: Mapping[str, str], env_id: str, conf_dir: Path = CONF_DIR) -> Choice[str | None] | None:
    """The plan's ``preset`` line (``applied``, or ``available`` under another env= option), or None: nothing to say.

    ``choices``: Hydra's ``runtime.choices`` (group -> option) of the run.
    """
    name = choices.get("specialize")
    if name and (conf_dir / "specialize" / f"{name}.yaml").exists():
        return Choice(name, "applied", {"summary": _summary(conf_dir / "specialize" / f"{name}.yaml")})
    family = family_of(env_id)
    trainer = choices.get("trainer", "")
    if family and choices.get("env") != family and (conf_dir / "specialize" / f"{trainer}_{family}.yaml").exists():
        return Choice(None, "available", {"env_id": env_id, "family": family, "file": f"{trainer}_{family}"})
    return None
