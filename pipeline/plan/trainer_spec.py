"""How a config builds its trainer: the runner's learner and the plan's trainer probes build it one way."""

from __future__ import annotations

import inspect
from typing import Any

from pipeline.plan.validate import import_target


def trainer_class(cfg: Any) -> Any:
    """The class ``trainer._target_`` names; one :class:`~pipeline.plan.validate.ConfigError` line when it cannot
    be imported (before any probe or process starts)."""
    return import_target("trainer._target_", str(cfg.trainer._target_))


#: observations smaller than this keep dense successors: recording cut ones costs the driver ~20 us a chunk piece,
#: more than copying every successor of a small one (driver CPU a frame, dense against cut, 4,096-frame batches of
#: 32-env chunks: 16 B 0.045 / 0.068 us, 256 B 0.178 / 0.142, 1 KB 0.459 / 0.349; 8-env chunks, 1 KB: 0.689 / 0.666)
CUT_SUCCESSORS_MIN_BYTES = 1024


def dense_successors(cfg: Any, env_spec: Any) -> bool:
    """Whether the run's batches carry every transition's successor observation (:mod:`components.successors`).

    Not when the trainer reads them only where trajectories are cut (PPO),
    nothing else reads every row (no replay, no ``post_collect_hook``, no
    trajectory grouping) and an observation is big enough for the copies
    saved to outweigh the bookkeeping (:data:`CUT_SUCCESSORS_MIN_BYTES`).
    """
    if bool(getattr(trainer_class(cfg), "dense_successors", True)):
        return True
    from components.successors import reads_every_row

    c = cfg.collector
    replay = str(cfg.replay.kind) != "none"  # the n-step post-processor comes only with replay
    if reads_every_row(replay=replay, postproc=replay, hook=bool(c.post_collect_hook),
                       trajectories=bool(c.yield_completed_trajectories)):
        return True
    return env_spec.obs_bytes < CUT_SUCCESSORS_MIN_BYTES


def build_trainer(cfg: Any, model: Any, env_spec: Any, device: str, policy_version: int, **overrides: Any) -> Any:
    """The trainer ``cfg.trainer._target_`` names, with its other keys (and ``overrides``) as hyper-parameters.

    A new algorithm is a new config, not a branch here. A trainer with
    networks of its own beside the served one (SAC's critics) takes the env
    spec, given to the partial, not to instantiate: Hydra would turn it into
    a config node.
    """
    from hydra.utils import instantiate

    takes_spec = "env_spec" in inspect.signature(trainer_class(cfg)).parameters
    extra = {"env_spec": env_spec} if takes_spec else {}
    make = instantiate(cfg.trainer, _partial_=True, _convert_="all", **overrides)
    return make(model=model, device=device, policy_version=policy_version, **extra)
