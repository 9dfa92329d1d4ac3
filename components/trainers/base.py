"""What the runner needs from a trainer: the :class:`Trainer` protocol.

Why the trainer owns the policy version: a version names a set of weights,
and only the trainer knows when its weights change. If the inference server
or the runner counted pushes instead, the count would drift from the
trainer's whenever one side pushed without the other knowing (the initial
push, a push that only changes the exploration rate, a resumed run), and
policy lag -- ``trainer.policy_version - data["policy_version"]`` -- would be
off by one. So the trainer counts, and every push carries its count:
``collector.update_policy_weights_(trainer.model, version=trainer.policy_version)``.
Version 0 is the initial weights; the server stamps each action with the
version it was computed by; lag is then exact (0 = data from the current
weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import nn

from components.trainers.budget import RunBudget


def config_from(config_class: type, config: Any, hyper: dict[str, Any], owner: str) -> Any:
    """A trainer's config: the one given, or one built from keyword hyper-parameters (how Hydra builds it)."""
    if config is None:
        return config_class(**hyper)
    if hyper:
        raise TypeError(f"{owner}: pass config or hyper-parameters, not both (got {sorted(hyper)})")
    return config


class NonFiniteError(RuntimeError):
    """A loss or gradient was NaN or infinite; the step that met it was not applied.

    The runner stops on it and keeps the last good checkpoint instead of
    saving weights that may already be poisoned.
    """


def check_finite(grad_norm: Any, loss: Any, where: str) -> None:
    """Raise :class:`NonFiniteError` unless ``grad_norm`` (which a non-finite loss also poisons) is finite."""
    import torch

    if not bool(torch.isfinite(grad_norm)):
        raise NonFiniteError(f"{where}: non-finite gradient norm {float(grad_norm)} (loss {float(loss)}); the "
                             "weights were not updated (check trainer.lr and the env's observations and rewards)")


@runtime_checkable
class Trainer(Protocol):
    """A learner the runner drives, on-policy or from replay.

    The runner's loop is the same for every trainer::

        metrics = trainer.update(data, frames=collector.frames)
        collector.update_policy_weights_(trainer.model, version=trainer.policy_version)

    where ``data`` is the collected batch when :attr:`on_policy` is true and
    the replay buffer otherwise.

    Optional: a class attribute ``dense_successors = False`` says the trainer
    reads ``("next", "observation")`` only where a trajectory is cut (an
    episode's end, an env's last transition in the batch), through
    :func:`components.successors.successor_observations`; its batches then
    carry those successors alone, not a second copy of every frame (PPO). A
    trainer without it gets the dense field.
    """

    #: True: learns from each collected batch once (PPO); False: from a replay buffer (DQN).
    on_policy: ClassVar[bool]
    #: budget and hyper-parameters; the runner reads the :class:`RunBudget` part
    config: RunBudget
    #: the network whose weights are served to the workers
    model: nn.Module

    @property
    def policy_version(self) -> int:
        """Version of :attr:`model`'s weights: 0 initially, +1 each time they change and are pushed."""
        ...

    def update(self, data: Any, *, frames: int) -> dict[str, float]:
        """Learn from ``data`` (a batch, or the replay buffer); ``frames`` collected so far drive schedules.

        Returns scalar metrics. Afterwards :attr:`policy_version` names the
        weights the runner pushes next.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, ``policy_version`` included."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        ...
