"""DQN: targets, exploration schedule, target-network updates, priorities, versions and replay."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from components.envs import EnvSpec
from components.models import QNetwork
from components.replay.buffer import ReplayBuffer
from components.replay.storage import TensorStorage
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
    _, td_abs = trainer.learn(batch)
    assert torch.allclose(td_abs, (expected - q).abs(), atol=1e-4)


def test_terminal_transitions_do_not_bootstrap():
    trainer = DQNTrainer(QNetwork(SPEC, hidden=(8,)), DQNConfig(lr=1e-9))
    batch = _sample(terminated=True)
    with torch.no_grad():
        q = trainer.model(batch["observation"]).gather(-1, batch["action"][:, None]).squeeze(-1)
    _, td_abs = trainer.learn(batch)
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
    trainer.learn(_sample())
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.target.parameters())), "not yet"
    trainer.learn(_sample())
    for old, target, online in zip(before, trainer.target.parameters(), trainer.model.parameters()):
        assert torch.allclose(target, old + tau * (online - old), atol=1e-6)


def _transitions(n: int, version: int, seed: int = 0) -> TensorDict:
    """``n`` stored transitions as the collector writes them, all from policy ``version``."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict({
        "observation": torch.randn(n, 3, generator=g), "action": torch.randint(0, 2, (n,), generator=g),
        "policy_version": torch.full((n,), version, dtype=torch.int64),
        "next": {"observation": torch.randn(n, 3, generator=g), "reward": torch.ones(n),
                 "terminated": torch.zeros(n, dtype=torch.bool), "n_steps": torch.ones(n, dtype=torch.int64)},
    }, batch_size=[n])


def _buffer(*versions: int, n: int = 32, **kwargs) -> ReplayBuffer:  # noqa: ANN003
    buffer = ReplayBuffer(TensorStorage(1000), seed=0, **kwargs)
    for i, version in enumerate(versions):
        buffer.extend(_transitions(n, version, seed=i))
    return buffer


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_update_learns_updates_per_batch_steps_from_the_buffer_and_bumps_the_version_once(sampler):
    config = DQNConfig(updates_per_batch=5, batch_size=16, learning_starts=10, total_frames=1000,
                       eps_start=1.0, eps_end=0.1, eps_fraction=0.5)
    trainer = DQNTrainer(QNetwork(SPEC, hidden=(8,)), config)
    buffer = _buffer(0, sampler=sampler)
    prioritized: list[int] = []
    update_priorities = buffer.update_priorities
    buffer.update_priorities = lambda idx, td: (prioritized.append(len(idx)), update_priorities(idx, td))  # type: ignore[method-assign]
    metrics = trainer.update(buffer, frames=250)
    assert trainer.updates == 5 and buffer.stats()["sample_calls"] == 5
    assert prioritized == ([16] * 5 if sampler == "prioritized" else [])
    assert trainer.policy_version == 1
    assert metrics["epsilon"] == pytest.approx(0.55)
    assert float(trainer.model.epsilon) == pytest.approx(0.55), "pushed with the weights"
    assert {"loss", "q_mean", "td_abs_mean", "grad_norm"} <= set(metrics)
    trainer.update(buffer, frames=500)
    assert trainer.updates == 10 and trainer.policy_version == 2


def test_before_learning_starts_no_step_is_taken_but_the_new_epsilon_gets_a_version():
    config = DQNConfig(updates_per_batch=5, batch_size=16, learning_starts=100, total_frames=1000,
                       eps_start=1.0, eps_end=0.1, eps_fraction=0.5)
    trainer = DQNTrainer(QNetwork(SPEC, hidden=(8,)), config)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    buffer = _buffer(0)
    metrics = trainer.update(buffer, frames=250)
    assert metrics == {"epsilon": pytest.approx(0.55)}
    assert trainer.updates == 0 and buffer.stats()["sample_calls"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert trainer.policy_version == 1


def test_samples_are_at_most_max_policy_lag_versions_old():
    config = DQNConfig(updates_per_batch=8, batch_size=32, learning_starts=0, total_frames=1000)
    trainer = DQNTrainer(QNetwork(SPEC, hidden=(8,)), config)
    buffer = _buffer(0, 1, 2, 3, max_policy_lag=1)
    drawn: dict[int, list[int]] = {}
    sample = buffer.sample

    def spy(batch_size: int, policy_version: int | None = None) -> TensorDict:
        assert policy_version == trainer.policy_version, "sampled for the trainer's own version"
        out = sample(batch_size, policy_version=policy_version)
        drawn.setdefault(policy_version, []).extend(out["policy_version"].tolist())
        return out

    buffer.sample = spy  # type: ignore[method-assign]
    for _ in range(4):
        trainer.update(buffer, frames=0)
    assert sorted(drawn) == [0, 1, 2, 3]
    for version, versions in drawn.items():
        assert min(versions) >= version - 1, f"at version {version} drew data {version - min(versions)} versions old"
    assert min(drawn[3]) == 2, "data exactly max_policy_lag versions old is still admitted"
