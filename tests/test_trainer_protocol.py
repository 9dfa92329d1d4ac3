"""The Trainer protocol: both trainers implement it, own their version from 0, and checkpoint it."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from components.envs import EnvSpec
from components.models import ActorCritic, QNetwork
from components.trainers.base import Trainer
from components.trainers.budget import RunBudget
from components.trainers.dqn import DQNConfig, DQNTrainer
from components.trainers.ppo import PPOConfig, PPOTrainer

SPEC = EnvSpec((4,), "float32", "discrete", action_n=2)


def _ppo() -> PPOTrainer:
    return PPOTrainer(ActorCritic(SPEC), PPOConfig(epochs=1, total_frames=1000))


def _dqn() -> DQNTrainer:
    return DQNTrainer(QNetwork(SPEC, hidden=(8,)), DQNConfig(learning_starts=10**9, total_frames=1000))


def _step(trainer: Trainer) -> None:
    """One update through the protocol, on the data the trainer learns from."""
    if trainer.on_policy:
        n = 8
        batch = TensorDict({
            "observation": torch.randn(n, 4), "action": torch.randint(0, 2, (n,)),
            "sample_log_prob": torch.full((n,), -0.69), "state_value": torch.zeros(n),
            "policy_version": torch.full((n,), trainer.policy_version), "env_index": torch.zeros(n, dtype=torch.long),
            "env_step": torch.arange(n),
            "next": {"observation": torch.randn(n, 4), "reward": torch.ones(n),
                     "terminated": torch.zeros(n, dtype=torch.bool), "truncated": torch.zeros(n, dtype=torch.bool)},
        }, batch_size=[n])
        trainer.update(batch, frames=n)
    else:
        trainer.update([], frames=8)  # an empty "buffer": before learning_starts


FACTORIES = {"ppo": _ppo, "dqn": _dqn}


@pytest.mark.parametrize("name", FACTORIES)
def test_trainers_satisfy_the_protocol_and_start_at_version_zero(name):
    trainer = FACTORIES[name]()
    assert isinstance(trainer, Trainer)
    assert isinstance(trainer.config, RunBudget) and isinstance(trainer.model, torch.nn.Module)
    assert trainer.on_policy is (name == "ppo")
    assert trainer.policy_version == 0, "version 0 is the initial weights"
    assert not hasattr(trainer, "version"), "the version has one owner and one name"


@pytest.mark.parametrize("name", FACTORIES)
def test_one_update_is_one_version(name):
    trainer = FACTORIES[name]()
    for expected in (1, 2):
        _step(trainer)
        assert trainer.policy_version == expected


@pytest.mark.parametrize("name", FACTORIES)
def test_state_dict_round_trips_the_version(name):
    trainer = FACTORIES[name]()
    _step(trainer)
    _step(trainer)
    state = trainer.state_dict()
    assert state["policy_version"] == 2
    fresh = FACTORIES[name]()
    fresh.load_state_dict(state)
    assert fresh.policy_version == 2
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.state_dict().values(), fresh.model.state_dict().values()))


@pytest.mark.parametrize(("cls", "config_cls", "model"), [(PPOTrainer, PPOConfig, ActorCritic),
                                                          (DQNTrainer, DQNConfig, QNetwork)])
def test_hyper_parameters_as_keywords_build_the_config_as_hydra_does(cls, config_cls, model):
    trainer = cls(model(SPEC), lr=0.0123, total_frames=777, device="cpu")
    assert isinstance(trainer.config, config_cls)
    assert trainer.config.lr == 0.0123 and trainer.config.total_frames == 777
    with pytest.raises(TypeError, match="not both"):
        cls(model(SPEC), config_cls(), lr=0.1)
