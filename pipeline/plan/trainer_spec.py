"""How a config builds its trainer: the runner's learner and the plan's trainer probes build it one way."""

from __future__ import annotations

import inspect
from typing import Any


def takes_env_spec(trainer_target: str) -> bool:
    """Whether the trainer class builds networks of its own from the env spec (SAC's critics)."""
    from hydra.utils import get_class

    try:
        return "env_spec" in inspect.signature(get_class(trainer_target)).parameters
    except Exception:  # noqa: BLE001 - an unimportable target is reported by instantiate, in its words
        return False


def build_trainer(cfg: Any, model: Any, env_spec: Any, device: str, policy_version: int, **overrides: Any) -> Any:
    """The trainer ``cfg.trainer._target_`` names, with its other keys (and ``overrides``) as hyper-parameters.

    A new algorithm is a new config, not a branch here. The env spec is
    given to the partial, not to instantiate: Hydra would turn it into a
    config node.
    """
    from hydra.utils import instantiate

    extra = {"env_spec": env_spec} if takes_env_spec(str(cfg.trainer._target_)) else {}
    make = instantiate(cfg.trainer, _partial_=True, _convert_="all", **overrides)
    return make(model=model, device=device, policy_version=policy_version, **extra)
