"""Which env option and hyper-parameter preset a run gets, read from the env itself.

Presets are ``conf/specialize/<trainer>_<env>.yaml`` files that Hydra
applies on their own when the pair matches (``env=mujoco`` with
``trainer=ppo`` gets ``ppo_mujoco.yaml``). A user names the env, not our
family option: ``env=gym env.id=LunarLander-v3`` runs as ``env=box2d``
would (its env settings and its preset), because the family is read from
the registered env's entry point (:func:`family_of`). The plan names the
preset and, when the env option was re-chosen, why.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline import CONF_DIR
from pipeline.plan.choice import Choice
from pipeline.plan.options import option_summary

#: env= option -> the modules its envs' entry points come from
FAMILIES = {"box2d": ("gymnasium.envs.box2d",), "mujoco": ("gymnasium.envs.mujoco",), "atari": ("ale_py",),
            "toy_text": ("gymnasium.envs.toy_text",),
            # continuous classic control only: CartPole and Acrobot keep the defaults
            "classic": ("gymnasium.envs.classic_control.pendulum",
                        "gymnasium.envs.classic_control.continuous_mountain_car")}


def _summary(path: Path) -> str:
    """The preset's description: its comment lines after the package line, as one sentence."""
    return option_summary(path, width=None)


def family_of(env_id: str) -> str | None:
    """``box2d``, ``mujoco``, ``atari``, ``toy_text`` or ``classic`` (continuous classic control) for a gymnasium id
    of those families."""
    try:
        import gymnasium as gym

        from components.envs import check_env_id

        check_env_id(env_id)  # registers ALE's ids on the way
        entry = str(gym.spec(env_id).entry_point)
    except Exception:  # noqa: BLE001 - an unknown id is the validator's business
        return None
    return next((name for name, modules in FAMILIES.items() if entry.startswith(modules)), None)


#: the env= option that takes any registered id, and re-chooses its family's option for it
GENERIC = "gym"


def env_option_for(choices: Mapping[str, str], env_id: str, conf_dir: Path = CONF_DIR) -> str | None:
    """The env= option to run ``env_id`` with when the run chose the generic ``env=gym``; None: keep the choice."""
    if choices.get("env") != GENERIC:
        return None
    family = family_of(env_id)
    return family if family and (conf_dir / "env" / f"{family}.yaml").exists() else None


def with_env_option(overrides: list[str], option: str) -> list[str]:
    """``overrides`` with the env group re-chosen (the other overrides, ``env.id`` included, kept as given)."""
    out = [f"env={option}" if o.split("=", 1)[0] == "env" else o for o in overrides]
    return out if out != list(overrides) else [*overrides, f"env={option}"]


def preset_choice(choices: Mapping[str, str], env_id: str, conf_dir: Path = CONF_DIR,
                  rechosen: str | None = None) -> Choice[str | None] | None:
    """The plan's ``preset`` line, or None when there is nothing to say.

    ``choices``: Hydra's ``runtime.choices`` (group -> option) the run
    composed with; ``rechosen``: the family option :func:`env_option_for`
    chose for an ``env=gym`` run (the line then says why).
    """
    name = choices.get("specialize")
    family = {"env_id": env_id, "family": rechosen} if rechosen else {}
    if name and (conf_dir / "specialize" / f"{name}.yaml").exists():
        return Choice(name, "applied", {"summary": _summary(conf_dir / "specialize" / f"{name}.yaml"), **family})
    if rechosen:
        return Choice(None, "family_without_preset", {**family, "trainer": choices.get("trainer", "")})
    family = family_of(env_id)
    trainer = choices.get("trainer", "")
    if family and choices.get("env") != family and (conf_dir / "specialize" / f"{trainer}_{family}.yaml").exists():
        return Choice(None, "available", {"env_id": env_id, "family": family, "file": f"{trainer}_{family}"})
    return None


#: the env id each preset's ``target_return`` was measured on (``None``: no preset, the trainers' defaults,
#: which are CartPole-v1's); for another id the run takes that id's own ``reward_threshold`` instead
TARGET_MEASURED_ON = {None: "CartPole-v1", "ppo_classic": "Pendulum-v1", "ppo_box2d": "LunarLander-v3",
                      "dqn_box2d": "LunarLander-v3", "ppo_toy_text": "Taxi-v4",
                      "ppo_no_velocity": "CartPole-v1"}


def _user_set(overrides: list[str], key: str) -> bool:
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in overrides)


def adapt_target(cfg: Any, overrides: list[str], choices: Mapping[str, str]) -> dict[str, Any] | None:
    """Give ``cfg`` the env's own target when its ``target_return`` was measured on another env; what changed.

    A preset's target belongs to the env it was tuned on: ``env=gym
    env.id=MountainCarContinuous-v0`` under the continuous classic preset
    (Pendulum's -200) stopped "solved" at a mean return of -36.6 after 24k
    frames. Another id gets its ``reward_threshold`` from gymnasium's
    registry, or no target (the run goes to ``total_frames``). A target the
    user set, or a preset without one, is left as it is.
    """
    target = cfg.trainer.get("target_return")
    env_id = str(cfg.env.get("id", ""))
    specialize = choices.get("specialize")
    if specialize in TARGET_MEASURED_ON:
        measured_on = TARGET_MEASURED_ON[specialize]
    elif specialize and (CONF_DIR / "specialize" / f"{specialize}.yaml").exists():
        return None  # a preset not listed (one without a target): nothing known to be another env's
    else:
        measured_on = TARGET_MEASURED_ON[None]  # no preset file: the trainers' defaults
    if target is None or not env_id or env_id == measured_on or _user_set(overrides, "trainer.target_return"):
        return None
    try:
        import gymnasium as gym

        threshold = gym.spec(env_id).reward_threshold
    except Exception:  # noqa: BLE001 - an unknown id is the validator's business
        return None
    cfg.trainer.target_return = None if threshold is None else float(threshold)
    return {"target": cfg.trainer.target_return, "target_was": float(target), "measured_on": measured_on,
            "env_id": env_id}


def preset_line(cfg: Any, overrides: list[str], choices: Mapping[str, str],
                rechosen: str | None = None) -> Choice[str | None] | None:
    """:func:`adapt_target` applied to ``cfg``, and the plan's ``preset`` line saying so (see :func:`preset_choice`)."""
    target = adapt_target(cfg, overrides, choices)
    choice = preset_choice(choices, str(cfg.env.id), rechosen=rechosen)
    if target is None:
        return choice
    if choice is None:
        return Choice(None, "defaults", target)
    return Choice(choice.value, choice.code, {**choice.facts, **target})
