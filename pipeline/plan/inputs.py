"""What the plan is decided from besides the config: the env's spec and the measured layout costs.

The runner and the benchmark's ``ours:*`` contenders both call
:func:`plan_config`, so a contender measures the graph the same command
would train with (the same probes, the same rules, the same fallbacks).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.plan.resolve import Machine, Plan, resolve_plan, serving_engine
from pipeline.plan.rules import device
from pipeline.plan.validate import ConfigError


@dataclass(frozen=True)
class PlannedConfig:
    """A validated config's plan, with the env factory and spec it was planned for."""

    plan: Plan
    env_factory: Any
    env_spec: Any
    #: the measured layout costs the plan chose from (None: decided by rule)
    costs: Any = None


def build_env(cfg: DictConfig) -> tuple[Any, Any]:
    """The env factory and the spec of one env it makes (an unknown id is a config error)."""
    from hydra.utils import instantiate

    from components.action_masks import MaskError, with_masks
    from components.envs import EnvConfigError, probe_env_spec

    if cfg.env.get("factories"):
        return build_env_set(cfg)
    try:
        env_factory = instantiate(cfg.env.factory, _convert_="all")
    except Exception as err:  # noqa: BLE001 - a user-given _target_ or argument
        cause = err.__cause__ or err
        raise ConfigError(f"env.factory: cannot build it: {type(cause).__name__}: "
                          f"{str(cause).splitlines()[0] if str(cause) else ''}") from None
    try:
        env_factory = with_masks(env_factory, cfg.env.get("action_mask_key"))
        return env_factory, probe_env_spec(env_factory)
    except (EnvConfigError, MaskError) as err:
        raise ConfigError(f"env.id={cfg.env.id!r}: {err}") from None


def build_env_set(cfg: DictConfig) -> tuple[Any, Any]:
    """``env.factories`` as an :class:`~components.env_set.EnvSet`, every entry probed: one spec for all, or one line."""
    from hydra.utils import instantiate

    from components.action_masks import MaskError, with_masks
    from components.env_set import EnvSet, EnvSetEntry
    from components.envs import EnvConfigError, probe_env_spec

    entries, specs = [], []
    for i, item in enumerate(cfg.env.factories):
        where = f"env.factories[{i}]"
        unknown = set(item) - {"factory", "count", "task", "seed_offset"}
        if "factory" not in item or unknown:
            raise ConfigError(f"{where}: needs factory (and count, task, seed_offset), "
                              + (f"not {sorted(unknown)}" if unknown else "has no factory"))
        try:
            factory = instantiate(item.factory, _convert_="all")
        except Exception as err:  # noqa: BLE001 - a user-given _target_ or argument
            cause = err.__cause__ or err
            raise ConfigError(f"{where}.factory: cannot build it: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}") from None
        count = item.get("count", 1)
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"{where}.count={count!r}: must be an integer >= 1")
        entries.append(EnvSetEntry(factory, count, str(item.get("task") or f"task{i}"),
                                   int(item.get("seed_offset") or 0)))
        try:
            factory = with_masks(factory, cfg.env.get("action_mask_key"))
            entries[-1] = EnvSetEntry(factory, count, entries[-1].task, entries[-1].seed_offset)
            specs.append(probe_env_spec(factory))
        except (EnvConfigError, MaskError) as err:
            raise ConfigError(f"{where}: {err}") from None
        if specs[-1] != specs[0]:
            raise ConfigError(f"{where} ({entries[-1].task}): its envs' spaces differ from {entries[0].task}'s "
                              f"({specs[-1]} vs {specs[0]}); one policy serves every entry")
    total = sum(e.count for e in entries)
    if total != int(cfg.env.num_envs):
        raise ConfigError(f"env.num_envs={cfg.env.num_envs}: env.factories make {total} envs "
                          f"({', '.join(f'{e.task} {e.count}' for e in entries)}); set env.num_envs={total}")
    try:
        env_set = EnvSet(entries)
    except ValueError as err:
        raise ConfigError(f"env.factories: {err}") from None
    return env_set, specs[0]


def layout_costs(cfg: DictConfig, env_factory: Any, env_spec: Any, machine: Machine, count_trainer: bool = True,
                 model_checked: bool = False) -> Any:
    """What ``transport=auto`` chooses the layout from (:mod:`pipeline.plan.layout`), probed in a few hundred ms.

    None when nothing is left to choose (``server=inline`` or ``transport=slots``)
    or the probe fails: the plan then falls back to its rule and says so.
    ``model_checked``: the run's model was built for this env already, so a
    ``ValueError``, ``KeyError`` or ``TypeError`` from the probe is the probe's
    own failure and is printed like any other (unchecked, it is taken for a
    model the env cannot have, which the learner's build reports in one line).
    """
    if str(cfg.transport.kind) != "auto" or str(cfg.server.backend) == "inline" or str(cfg.workers.backend) == "ray":
        return None
    if OmegaConf.select(cfg, "deterministic", default=False):
        return None  # the layout by rule: a measurement could plan another graph (other batch shapes) next time
    from pipeline.plan.probes import probe_for_config

    policy_device = device(str(cfg.device.policy_device), machine.cuda).value
    trainer_device = device(str(cfg.device.trainer_device), machine.cuda).value
    engine = serving_engine(cfg, policy_device, env_spec).value
    try:
        return probe_for_config(cfg, env_factory, env_spec, machine.cpus, policy_device, engine, trainer_device,
                                count_trainer)
    except (ValueError, KeyError, TypeError) as err:
        if model_checked:
            _fallback_warning(err)
        return None  # unchecked: a model this env cannot have, which the learner's build says in one line, next
    except Exception as err:  # noqa: BLE001 - the rule still gives a working layout
        _fallback_warning(err)
        return None


def _fallback_warning(err: BaseException) -> None:
    print(f"warning: the layout probe failed ({type(err).__name__}: {err}); transport=auto falls back to its "
          "rule", file=sys.stderr, flush=True)


def plan_config(cfg: DictConfig, machine: Machine, count_trainer: bool = True) -> PlannedConfig:
    """Build the env, probe the layout when ``auto`` asks for it, and resolve the plan (``cfg`` validated).

    ``count_trainer=False``: the layout for collection alone (see :func:`~pipeline.plan.probes.probe_for_config`).
    """
    from pipeline.plan.model_spec import build_model, model_spec_for
    from pipeline.plan.trainer_spec import trainer_class

    trainer_class(cfg)  # a trainer that does not import is one line now, not a probe's or the learner's traceback
    env_factory, env_spec = build_env(cfg)
    model_checked = str(cfg.trainer.name) in ("ppo", "dqn", "sac")
    if model_checked:  # a wrong model is one line now, not a failed probe or worker
        build_model(cfg, model_spec_for(cfg), env_spec)
    costs = layout_costs(cfg, env_factory, env_spec, machine, count_trainer, model_checked)
    return PlannedConfig(resolve_plan(cfg, machine, env_spec, costs), env_factory, env_spec, costs)


def compose(overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """The config ``python -m pipeline *overrides`` runs with (Hydra's composition, presets included).

    ``with_hydra``: keep the ``hydra`` node (its ``runtime.choices`` say which option each group got).
    ``env=gym`` with an id of a family that has its own option is composed as that option, as the
    runner does (:func:`family_config`).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from pipeline import CONF_DIR
    from pipeline.plan.schema import register

    register()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
        rechosen = family_config(cfg, list(overrides), dict(cfg.hydra.runtime.choices))
        if rechosen is not None:
            cfg = hydra_compose("config", overrides=rechosen[1], return_hydra_config=True)
        from pipeline.plan.presets import adapt_target

        adapt_target(cfg, list(overrides), dict(cfg.hydra.runtime.choices))  # as the runner's preset line does
        if not with_hydra:
            with open_dict(cfg):
                del cfg["hydra"]
        return cfg


def family_config(cfg: DictConfig, overrides: list[str], choices: dict[str, str]) -> tuple[str, list[str]] | None:
    """``(option, overrides)`` to compose instead when ``env=gym`` names an env of a family with its own option.

    A user names the env, not our family config: ``env=gym env.id=LunarLander-v3`` runs with what
    ``env=box2d`` sets (16 envs, the Box2D preset), not with CartPole's settings. None: keep ``cfg``.
    """
    from pipeline.plan.presets import env_option_for, with_env_option

    option = env_option_for(choices, str(cfg.env.id))
    return None if option is None else (option, with_env_option(overrides, option))
