"""What a run's default directory and wandb run are called after: the env it steps."""

from __future__ import annotations

import re
from typing import Any

#: a gymnasium id or factory name is cut to this many characters in a run directory's name
ENV_LABEL_CHARS = 40
_GYM_FACTORY = "components.envs.GymEnvFactory"


def env_label(env_id: Any, factory_target: Any = None, factories: Any = None) -> str:
    """The env a run steps, as its default directory (and wandb run) name says it.

    The ``env=`` option's short name says which config family was composed,
    not what ran: ``env=gym env.id=Acrobot-v1`` and ``env=gym env.id=Pendulum-v1``
    both read ``gym``, and a user's own factory under the default option
    read ``cartpole``. So: the gymnasium id for gymnasium factories, the
    factory's own name otherwise, ``envset`` for ``env.factories``; only
    characters safe in a path.

    Examples:
        >>> env_label("ALE/Pong-v5", "components.envs.GymEnvFactory")
        'ALE-Pong-v5'
        >>> env_label("CartPole-v1", "byo_example.PickEnvFactory")
        'PickEnv'
        >>> env_label("CartPole-v1", None, [{"factory": {}}])
        'envset'
    """
    if factories:
        return "envset"
    target = "" if factory_target is None else str(factory_target)
    if target and target != _GYM_FACTORY:
        name = target.rpartition(".")[2].rpartition(":")[2]
        label = name[: -len("Factory")] if name.endswith("Factory") and len(name) > len("Factory") else name
    else:
        label = str(env_id)
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "env"
    return label[:ENV_LABEL_CHARS]
