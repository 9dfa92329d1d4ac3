"""What a run's default directory and wandb run are called after: the env it steps."""

from __future__ import annotations

import re
from typing import Any

#: a label is cut to this many characters in a run directory's name
ENV_LABEL_CHARS = 48
#: factories that only make the env their ``id`` names (the label is the id alone)
PLAIN_FACTORIES = ("components.envs.GymEnvFactory", "components.envs.AtariEnvFactory")


def env_label(factory_id: Any = None, factory_target: Any = None, factories: Any = None) -> str:
    """The env a run steps, as its default directory (and wandb run) name says it.

    The ``env=`` option's short name says which config family was composed,
    not what ran: ``env=gym env.id=Acrobot-v1`` and ``env=gym env.id=Pendulum-v1``
    both read ``gym``, and a user's own factory under the default option
    read ``cartpole``. So: the id a factory makes (``ALE-Pong-v5``), after
    the factory's name when it does more than make it
    (``NoVelocityEnv-CartPole-v1``); the factory's name when it takes no id
    (``PickEnv`` for ``PickEnvFactory``); ``envset`` for ``env.factories``.
    Only characters safe in a path.

    Examples:
        >>> env_label("ALE/Pong-v5", "components.envs.AtariEnvFactory")
        'ALE-Pong-v5'
        >>> env_label(None, "byo_example.PickEnvFactory")
        'PickEnv'
        >>> env_label("CartPole-v1", "components.partial_obs.NoVelocityEnvFactory")
        'NoVelocityEnv-CartPole-v1'
        >>> env_label("CartPole-v1", None, [{"factory": {}}])
        'envset'
    """
    if factories:
        return "envset"
    target = "" if factory_target is None else str(factory_target)
    name = target.rpartition(".")[2].rpartition(":")[2]
    if name.endswith("Factory") and len(name) > len("Factory"):
        name = name[: -len("Factory")]
    if factory_id is not None and str(factory_id):
        label = str(factory_id) if not name or target in PLAIN_FACTORIES else f"{name}-{factory_id}"
    else:
        label = name
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "env"
    return label[:ENV_LABEL_CHARS]
