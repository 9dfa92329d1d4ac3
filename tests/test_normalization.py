"""Observation normalisation inside the policy, reward scaling in the learner."""

from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from components.envs import EnvSpec
from components.inference.loop import ServerConfig
from components.inference.server import InferenceServer
from components.inference.serving import NumpyActorCritic
from components.inference.slots import SlotTransport
from components.inference.transport import derive_layout
from components.interaction import InteractionMode
from components.models import ActorCritic, ModelSpec
from components.normalization import RewardScaler, RunningNorm
from components.trainers.ppo import PPOTrainer
from pipeline.runner.state import load_run_state, run_state, save_run_state

SPEC = EnvSpec((3,), "float32", "continuous", action_shape=(2,), action_low=(-1.0, -1.0), action_high=(1.0, 1.0))
GREEDY = int(InteractionMode.DETERMINISTIC)


def _batch(n: int, version: int, rng: np.random.Generator, offset: float = 50.0) -> TensorDict:
    env = torch.arange(n) % 2
    return TensorDict({
        "observation": torch.from_numpy(rng.normal(offset, 5.0, (n, 3)).astype(np.float32)),
        "action": torch.from_numpy(rng.normal(0, 1, (n, 2)).astype(np.float32)),
        "sample_log_prob": torch.full((n,), -2.0), "state_value": torch.zeros(n),
        "policy_version": torch.full((n,), version), "env_index": env, "env_step": torch.arange(n) // 2,
        "next": {"observation": torch.from_numpy(rng.normal(offset, 5.0, (n, 3)).astype(np.float32)),
                 "reward": torch.from_numpy(rng.normal(100.0, 10.0, n).astype(np.float32)),
                 "terminated": torch.zeros(n, dtype=torch.bool), "truncated": torch.zeros(n, dtype=torch.bool),
                 "done": torch.zeros(n, dtype=torch.bool)},
    }, batch_size=[n])


def test_running_statistics_equal_the_statistics_of_everything_seen():
    rng = np.random.default_rng(0)
    norm = RunningNorm((3,))
    seen = [rng.normal(7.0, 3.0, (n, 3)) for n in (1, 5, 64, 300)]
    for rows in seen:
        norm.update(torch.from_numpy(rows))
    everything = np.concatenate(seen)
    np.testing.assert_allclose(norm.mean.numpy(), everything.mean(0), rtol=1e-10)
    np.testing.assert_allclose(norm.var.numpy(), everything.var(0), rtol=1e-10)
    assert float(norm.count[0]) == len(everything)
    out = norm(torch.from_numpy(everything).float())
    assert abs(float(out.mean())) < 1e-3 and abs(float(out.std()) - 1) < 1e-2


def test_the_numpy_engine_normalises_exactly_like_the_model():
    model = ActorCritic(SPEC, hidden=(16,), obs_norm=True)
    model.obs_norm.update(torch.randn(100, 3) * 4 + 20)
    engine = NumpyActorCritic(model, seed=0)
    obs = (np.random.default_rng(1).normal(20, 4, (9, 3))).astype(np.float32)
    modes = np.full(9, GREEDY, np.int8)
    ours = engine.act({"observation": obs}, modes)
    with torch.no_grad():
        ref = model.act({"observation": torch.from_numpy(obs)}, torch.from_numpy(modes))
    np.testing.assert_allclose(ours["action"], ref["action"].numpy(), atol=1e-5)
    np.testing.assert_allclose(ours["state_value"], ref["state_value"].numpy(), atol=1e-5)


def test_the_trainer_updates_the_statistics_after_its_gradient_steps():
    rng = np.random.default_rng(2)
    trainer = PPOTrainer(ActorCritic(SPEC, hidden=(16,), obs_norm=True), epochs=1, minibatches=1, total_frames=10_000)
    batch = _batch(64, 0, rng)
    trainer.update(batch, frames=64)
    np.testing.assert_allclose(trainer.model.obs_norm.mean.numpy(), batch["observation"].double().mean(0).numpy(),
                               rtol=1e-6)
    assert trainer.policy_version == 1


@pytest.mark.parametrize("engine", ["torch", "numpy"])
@pytest.mark.parametrize("placement", ["thread", "process"])
def test_the_server_acts_with_the_statistics_pushed_with_the_weights(placement, engine):
    model = ActorCritic(SPEC, hidden=(16,), obs_norm=True)
    model.obs_norm.update(torch.randn(200, 3) * 5 + 30)
    spec = ModelSpec("components.models.ActorCritic", {"hidden": [16], "obs_norm": True})
    ctx = threading if placement == "thread" else mp.get_context("spawn")
    transport = SlotTransport(derive_layout(model, SPEC.observation_field()), num_slots=1, rows_per_slot=5, ctx=ctx)
    client = transport.client()
    obs = np.random.default_rng(3).normal(30, 5, (5, 3)).astype(np.float32)
    server = InferenceServer(spec, transport, ServerConfig(engine=engine), env_spec=SPEC, placement=placement,
                             ctx=mp.get_context("spawn"))
    try:
        server.update_weights(model, version=4)  # before start: served from the first request
        server.start()
        client.request["observation"][:] = obs
        client.submit(mode=GREEDY)
        out = client.wait(timeout=30)
    finally:
        server.shutdown()
    with torch.no_grad():
        ref = model.act({"observation": torch.from_numpy(obs)}, torch.full((5,), GREEDY, dtype=torch.int8))
    np.testing.assert_allclose(out["action"], ref["action"].numpy(), atol=1e-5)
    assert int(out["policy_version"][0]) == 4


def test_statistics_and_reward_scale_survive_a_checkpoint_round_trip(tmp_path):
    from components.episodes import EpisodeTracker

    rng = np.random.default_rng(4)
    trainer = PPOTrainer(ActorCritic(SPEC, hidden=(16,), obs_norm=True), epochs=1, minibatches=1,
                         total_frames=10_000, reward_scale=True)
    for v in range(3):
        trainer.update(_batch(64, v, rng), frames=64 * (v + 1))
    state = run_state(trainer=trainer, frames=192, config={}, model_spec=ModelSpec("components.models.ActorCritic"),
                      env_spec=SPEC, tracker=EpisodeTracker(3), stop_reason="checkpoint", wandb_id=None)
    loaded = load_run_state(save_run_state(tmp_path / "checkpoint.pt", state))  # weights_only=True
    fresh = PPOTrainer(ActorCritic(SPEC, hidden=(16,), obs_norm=True), reward_scale=True, total_frames=10_000)
    fresh.load_state_dict(loaded)
    obs = torch.from_numpy(rng.normal(50, 5, (7, 3)).astype(np.float32))
    modes = torch.full((7,), GREEDY, dtype=torch.int8)
    with torch.no_grad():
        a = trainer.model.act({"observation": obs}, modes)
        b = fresh.model.act({"observation": obs}, modes)
    assert torch.equal(a["action"], b["action"]) and torch.equal(a["state_value"], b["state_value"])
    assert torch.equal(fresh.model.obs_norm.var, trainer.model.obs_norm.var)
    assert fresh.reward_scaler.state_dict()["moments"].tolist() == trainer.reward_scaler.state_dict()["moments"].tolist()


def test_reward_scaling_carries_each_envs_return_across_batches_and_cuts_at_gaps():
    a, b = RewardScaler(gamma=0.9), RewardScaler(gamma=0.9)
    env = np.zeros(6, np.int64)
    step = np.arange(6)
    reward, done = np.ones(6), np.zeros(6, bool)
    a.scale(env, step, reward, done)
    b.scale(env[:3], step[:3], reward[:3], done[:3])
    b.scale(env[3:], step[3:], reward[3:], done[3:])
    assert b.state_dict()["returns"].tolist() == a.state_dict()["returns"].tolist()
    c = RewardScaler(gamma=0.9)
    c.scale(env[:3], step[:3], reward[:3], done[:3])
    c.scale(env[3:], step[3:] + 1, reward[3:], done[3:])  # a gap: a restarted worker's envs
    assert c.state_dict()["returns"].tolist() != a.state_dict()["returns"].tolist()


def test_normalisation_is_refused_where_it_does_not_apply():
    from components.models import QNetwork

    with pytest.raises(ValueError, match="model.obs_norm=true"):
        QNetwork(EnvSpec((4,), "float32", "discrete", action_n=2), obs_norm=True)
    with pytest.raises(ValueError, match="obs_norm applies to vector observations"):
        ActorCritic(EnvSpec((4, 84, 84), "uint8", "discrete", action_n=6), encoder="nature_cnn", obs_norm=True)
