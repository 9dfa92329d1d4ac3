"""DQN: targets, exploration schedule, target-network updates, priorities."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from components.envs import EnvSpec
from components.models import QNetwork
from components.trainers.dqn import DQNConfig, DQNTrainer

SPEC = EnvSpec((3,), "float32", "discrete", action_n=2)


def _sample(n: int = 8, n_steps: int = 1, terminated: bool = False) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict({
        "observation": torch.randn(n, 3, generator=g), "action": torch.randint(0, 2, (n,), generator=g),
        "weight": torch.ones(n), "index": torch.arange(n),
        "next": {"observation": torch.randn(n, 3, generator=g), "reward": torch.ones(n),
                 "terminated": torch.full((n,), terminated), "n_steps": torch.full((n,), n_steps)},
    }, batch_size=[n])


def test_double_dqn_target_uses_online_argmax_and_target_values():
    config = DQNConfig(gamma=0.9, lr=1e-9, target_update_period=1000)
    trainer = DQNTrainer(QNetwork(SPEC, hidden=(8,)), config)
    with torch.no_grad():  # make the networks disagree
        for p in trainer.target.parameters():
            p.add_(torch.randn_like(p))
    batch = _sample(n_steps=3)
    with torch.no_grad():
        best = trainer.model(batch["next", "observation"]).argmax(-1, keepdim=True)
        bootstrap = trainer.target(batch["next", "observation"]).gather(-1, best).squeeze(-1)
        expected = 1.0 + 0.9**3 * bootstrap
        q = trainer.model(batch["observation"]).gather(-1, batch["action"][:, None]).squeeze(-1)
    _, td_abs = trainer.update(batch)
    assert torch.allclose(td_abs, (expected - q).abs(), atol=1e-4)


def test_terminal_transitions_do_not_bootstrap():
    trainer = DQNTrainer(QNetwork(SPEC, hidden=(8,)), DQNConfig(lr=1e-9))
    batch = _sample(terminated=True)
    with torch.no_grad():
        q = trainer.model(batch["observation"]).gather(-1, batch["action"][:, None]).squeeze(-1)
    _, td_abs = trainer.update(batch)
    assert torch.allclose(td_abs, (1.0 - q).abs(), atol=1e-4)


def test_exploration_decays_linearly_and_lives_in_the_network():
    trainer = DQNTrainer(QNetwork(SPEC), DQNConfig(total_frames=1000, eps_start=1.0, eps_end=0.1, eps_fraction=0.5))
    assert trainer.set_exploration(0) == pytest.approx(1.0)
    assert trainer.set_exploration(250) == pytest.approx(0.55)
    assert trainer.set_exploration(900) == pytest.approx(0.1)
    assert float(trainer.model.state_dict()["epsilon"]) == pytest.approx(0.1), "pushed with the weights"


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_target_network_follows_the_online_one_every_period(tau):
    trainer = DQNTrainer(QNetwork(SPEC, hidden=(8,)), DQNConfig(target_update_period=2, tau=tau, lr=0.1))
    before = [p.clone() for p in trainer.target.parameters()]
    trainer.update(_sample())
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.target.parameters())), "not yet"
    trainer.update(_sample())
    for old, target, online in zip(before, trainer.target.parameters(), trainer.model.parameters()):
        assert torch.allclose(target, old + tau * (online - old), atol=1e-6)
