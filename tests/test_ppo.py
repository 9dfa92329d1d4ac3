"""PPO: advantages, exact policy lag and stale-data filtering, and that it actually learns CartPole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from components.envs import EnvSpec, GymEnvFactory
from components.episodes import EpisodeTracker
from components.models import ActorCritic, ModelSpec
from components.trainers.ppo import PPOConfig, PPOTrainer, gae

CARTPOLE = EnvSpec((4,), "float32", "discrete", action_n=2)


def _reference_gae(rewards, values, last_values, dones, gamma, lam):  # noqa: ANN001, ANN202
    """CleanRL's loop over a [T, N] rollout (dones[t] ends the episode after step t)."""
    steps = rewards.shape[0]
    adv = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[1])
    for t in reversed(range(steps)):
        next_values = last_values if t == steps - 1 else values[t + 1]
        nonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_values * nonterminal - values[t]
        running = delta + gamma * lam * nonterminal * running
        adv[t] = running
    return adv


def test_gae_over_env_ordered_rows_matches_the_time_major_reference():
    rng = np.random.default_rng(0)
    steps, envs = 12, 3
    rewards, values = rng.normal(size=(steps, envs)), rng.normal(size=(steps, envs))
    dones = rng.random((steps, envs)) < 0.2
    last_values = rng.normal(size=envs)
    expected = _reference_gae(rewards, values, last_values, dones.astype(float), 0.97, 0.9)
    # the same rollout as rows ordered per env, then step
    r, v, d = rewards.T.ravel(), values.T.ravel(), dones.T.ravel()
    last = np.zeros((envs, steps), bool)
    last[:, -1] = True
    last = last.ravel()
    next_values = np.where(last, np.repeat(last_values, steps), np.roll(v, -1))
    adv = gae(r, v, next_values, d, ~d & ~last, 0.97, 0.9)
    assert np.allclose(adv, expected.T.ravel())


def _batch(n: int, versions: list[int]) -> TensorDict:
    env = torch.arange(n) % 2
    step = torch.arange(n) // 2
    return TensorDict({
        "observation": torch.randn(n, 4), "action": torch.randint(0, 2, (n,)),
        "sample_log_prob": torch.full((n,), -0.69), "state_value": torch.zeros(n),
        "policy_version": torch.tensor(versions), "env_index": env, "env_step": step,
        "next": {"observation": torch.randn(n, 4), "reward": torch.ones(n),
                 "terminated": torch.zeros(n, dtype=torch.bool), "truncated": torch.zeros(n, dtype=torch.bool),
                 "done": torch.zeros(n, dtype=torch.bool)},
    }, batch_size=[n])


def _updated(trainer: PPOTrainer, k: int) -> PPOTrainer:
    """``k`` real updates, each on fresh data (stamped with the current version)."""
    for _ in range(k):
        version = trainer.policy_version
        trainer.update(_batch(8, [version] * 8), frames=8 * (version + 1))
        assert trainer.policy_version == version + 1
    return trainer


def test_data_from_the_current_weights_has_lag_zero():
    trainer = PPOTrainer(ActorCritic(CARTPOLE), PPOConfig(epochs=1, total_frames=1000))
    assert trainer.policy_version == 0, "version 0 is the initial weights"
    metrics = trainer.update(_batch(8, [0] * 8), frames=8)
    assert metrics["policy_lag_mean"] == 0 and metrics["policy_lag_max"] == 0
    assert metrics["dropped_stale_frames"] == 0 and metrics["trained_frames"] == 8
    assert trainer.policy_version == 1


def test_lag_counts_updates_since_the_data_was_produced():
    k = 3
    trainer = _updated(PPOTrainer(ActorCritic(CARTPOLE), PPOConfig(epochs=1, total_frames=1000, max_policy_lag=5)), k)
    metrics = trainer.update(_batch(8, [0] * 8), frames=8 * (k + 1))
    assert metrics["policy_lag_mean"] == k and metrics["policy_lag_max"] == k


def test_transitions_older_than_max_policy_lag_are_dropped_and_counted():
    trainer = _updated(PPOTrainer(ActorCritic(CARTPOLE), PPOConfig(max_policy_lag=1, epochs=1, total_frames=1000)), 3)
    metrics = trainer.update(_batch(8, [0, 1, 2, 3, 0, 1, 2, 3]), frames=32)
    assert metrics["dropped_stale_frames"] == 4, "versions 0 and 1 are 3 and 2 updates old"
    assert metrics["trained_frames"] == 4, "versions 2 and 3 (lag 1 and 0) are kept"
    assert metrics["policy_lag_max"] == 3
    assert trainer.policy_version == 4


def test_lr_anneals_over_the_frames_collected_before_the_batch():
    trainer = PPOTrainer(ActorCritic(CARTPOLE), PPOConfig(epochs=1, total_frames=32, lr=1e-3, anneal_lr=True))
    assert trainer.update(_batch(8, [0] * 8), frames=8)["lr"] == pytest.approx(1e-3)
    assert trainer.update(_batch(8, [1] * 8), frames=24)["lr"] == pytest.approx(0.5e-3)


def test_an_update_moves_the_parameters():
    model = ActorCritic(CARTPOLE)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = PPOTrainer(model, PPOConfig(epochs=2, minibatches=2, total_frames=1000))
    metrics = trainer.update(_batch(16, [0] * 16), frames=16)
    assert all(np.isfinite(v) for v in metrics.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.timeout(180)
def test_ppo_clearly_improves_cartpole_within_a_fixed_budget():
    # imported here: the unit tests above do not need the collector graph
    from components.collector.collector import AsyncBatchedCollector, GraphSpec

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = PPOConfig(frames_per_batch=256, total_frames=40_000, lr=1e-3, anneal_lr=False, gamma=0.98,
                       gae_lambda=0.8, epochs=20, minibatches=1, ent_coef=0.0, max_policy_lag=3)
    spec = ModelSpec("components.models.ActorCritic", {})
    collector = AsyncBatchedCollector(
        GymEnvFactory("CartPole-v1"), spec, GraphSpec(num_envs=8, envs_per_worker=8),
        frames_per_batch=config.frames_per_batch, total_frames=config.total_frames, seed=0,
    )
    trainer = PPOTrainer(spec.build(collector.env_spec), config)
    collector.update_policy_weights_(trainer.model, version=trainer.policy_version)
    tracker, first, best = EpisodeTracker(20), None, 0.0
    try:
        for batch in collector:
            tracker.add_batch(batch)
            if tracker.full:
                first = tracker.mean_return if first is None else first
                best = max(best, tracker.mean_return)
            trainer.update(batch, frames=collector.frames)
            collector.update_policy_weights_(trainer.model, version=trainer.policy_version)
    finally:
        collector.shutdown()
        torch.set_num_threads(threads)
    assert first is not None and first < 60, "an untrained policy balances for a few dozen steps"
    assert best >= 200, f"best mean return over 20 episodes {best:.0f} within {config.total_frames} frames"
