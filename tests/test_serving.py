"""Serving engines: the numpy engine serves the same policy as torch."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from components.envs import EnvSpec
from components.interaction import InteractionMode
from components.models import ActorCritic
from components.inference.numpy_engine import CONVERT_COLUMNS, first_product
from components.inference.serving import NumpyActorCritic, NumpyQNetwork, TorchEngine, serving_engine
from components.models import QNetwork

DISCRETE = EnvSpec((4,), "float32", "discrete", action_n=3)
CONTINUOUS = EnvSpec((5,), "float32", "continuous", action_shape=(2,), action_low=(-1.0, -1.0), action_high=(1.0, 1.0))


@pytest.mark.parametrize("spec", [DISCRETE, CONTINUOUS], ids=["discrete", "continuous"])
def test_numpy_engine_matches_torch_log_probs_values_and_greedy_actions(spec):
    torch.manual_seed(0)
    model = ActorCritic(spec, hidden=(32, 16))
    engine = NumpyActorCritic(model, seed=0)
    obs = np.random.default_rng(0).normal(size=(64, *spec.obs_shape)).astype(np.float32)
    greedy = np.full(64, int(InteractionMode.DETERMINISTIC), np.int8)
    out = engine.act({"observation": obs}, greedy)
    with torch.no_grad():
        ref = model.act({"observation": torch.from_numpy(obs)}, torch.from_numpy(greedy))
    assert np.allclose(out["action"], ref["action"].numpy(), atol=1e-5)
    assert np.allclose(out["sample_log_prob"], ref["sample_log_prob"].numpy(), atol=1e-4)
    assert np.allclose(out["state_value"], ref["state_value"].numpy(), atol=1e-5)
    sampled = engine.act({"observation": obs}, np.zeros(64, np.int8))
    log_prob, _, _ = model.evaluate(torch.from_numpy(obs), torch.as_tensor(sampled["action"]))
    assert np.allclose(sampled["sample_log_prob"], log_prob.detach().numpy(), atol=1e-4)


#: wider than one conversion block, with a part-filled last block
WIDE = 2 * CONVERT_COLUMNS + 123


@pytest.mark.parametrize("obs_norm", [False, True], ids=["raw", "normalised"])
def test_wide_integer_rows_are_converted_in_blocks_and_act_as_the_torch_model(obs_norm):
    torch.manual_seed(0)
    spec = EnvSpec((WIDE,), "uint8", "discrete", action_n=4)
    model = ActorCritic(spec, hidden=(8,), obs_norm=obs_norm)
    obs = np.random.default_rng(0).integers(0, 256, (9, WIDE), dtype=np.uint8)
    if obs_norm:
        model.obs_norm.update(torch.from_numpy(obs).double() * 0.5 + 3)
    engine = NumpyActorCritic(model, seed=0)
    greedy = np.full(9, int(InteractionMode.DETERMINISTIC), np.int8)
    out = engine.act({"observation": obs}, greedy)
    with torch.no_grad():
        ref = model.act({"observation": torch.from_numpy(obs)}, torch.from_numpy(greedy))
    assert out["action"].tolist() == ref["action"].tolist()
    np.testing.assert_allclose(out["state_value"], ref["state_value"].numpy(), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(out["sample_log_prob"], ref["sample_log_prob"].numpy(), rtol=1e-4, atol=1e-3)

    net = QNetwork(spec, hidden=(8,))
    net.epsilon.fill_(0.0)
    q_engine = NumpyQNetwork(net, seed=0)
    with torch.no_grad():
        assert q_engine.act({"observation": obs}, greedy)["action"].tolist() == net(torch.from_numpy(obs).float()).argmax(-1).tolist()


def test_the_blocked_product_equals_the_product_of_the_converted_rows():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (5, WIDE), dtype=np.uint8)
    weight = rng.normal(size=(WIDE, 6)).astype(np.float32)
    mean, inv_std = rng.normal(size=WIDE).astype(np.float32), rng.uniform(0.5, 2, WIDE).astype(np.float32)
    np.testing.assert_allclose(first_product(x, weight), x.astype(np.float32) @ weight, rtol=1e-4, atol=1e-2)
    normalised = np.clip((x.astype(np.float32) - mean) * inv_std, -5.0, 5.0)
    np.testing.assert_allclose(first_product(x, weight, (mean, inv_std, 5.0)), normalised @ weight, rtol=1e-4, atol=1e-3)
    narrow = x[:, :100]
    np.testing.assert_array_equal(first_product(narrow, weight[:100]), narrow.astype(np.float32) @ weight[:100])


def test_numpy_engine_samples_with_the_policy_probabilities():
    model = ActorCritic(DISCRETE, hidden=(8,))
    with torch.no_grad():
        model.actor[-1].weight.zero_()
        model.actor[-1].bias.copy_(torch.log(torch.tensor([0.2, 0.3, 0.5])))
    engine = NumpyActorCritic(model, seed=1)
    actions = engine.act({"observation": np.zeros((20000, 4), np.float32)}, np.zeros(20000, np.int8))["action"]
    assert np.allclose(np.bincount(actions, minlength=3) / 20000, [0.2, 0.3, 0.5], atol=0.015)


def test_refresh_picks_up_new_weights():
    model = ActorCritic(DISCRETE, hidden=(8,))
    engine = NumpyActorCritic(model)
    obs = {"observation": np.ones((2, 4), np.float32)}
    before = engine.act(obs)["state_value"].copy()
    with torch.no_grad():
        model.critic[-1].bias.add_(5.0)
    assert np.allclose(engine.act(obs)["state_value"], before)
    engine.refresh()
    assert np.allclose(engine.act(obs)["state_value"], before + 5.0, atol=1e-5)


def test_auto_picks_numpy_for_cpu_mlps_and_torch_otherwise():
    assert serving_engine(ActorCritic(DISCRETE), "auto", "cpu").name == "numpy"
    cnn = ActorCritic(EnvSpec((4, 84, 84), "uint8", "discrete", action_n=6), encoder="nature_cnn")
    assert isinstance(serving_engine(cnn, "auto", "cpu"), TorchEngine)
    with pytest.raises(ValueError, match="only MLP encoders"):
        serving_engine(cnn, "numpy", "cpu")
    assert isinstance(serving_engine(ActorCritic(DISCRETE), "torch", "cpu"), TorchEngine)


def test_lock_free_weight_reads_never_see_half_a_publish_and_survive_a_dead_lock_holder():
    """``read_into`` (inline workers) retries around publishes and never takes the lock."""
    import threading

    from components.inference.weights import SharedWeights

    template = {"w": torch.zeros(4096)}
    shared = SharedWeights(template, threading)
    target = torch.nn.Module()
    target.register_buffer("w", torch.zeros(4096))
    stop = threading.Event()

    def publisher() -> None:
        v = 0
        while not stop.is_set():
            v += 1
            shared.publish({"w": torch.full((4096,), float(v))}, version=v)

    thread = threading.Thread(target=publisher, daemon=True)
    thread.start()
    torn = reads = 0
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            got = shared.read_into(target)
            if got is None:
                continue
            reads += 1
            values = target.w.unique()
            if values.numel() != 1 or int(values[0]) != got[0]:
                torn += 1
    finally:
        stop.set()
        thread.join(5)
    assert reads > 0 and torn == 0
    shared._lock.acquire()  # a reader killed while holding the lock (copy_into) would block forever
    try:
        shared._writing[0] = 0
        assert shared.read_into(target) is not None
        shared._writing[0] = 1  # a publish that never finishes: the reader gives up and keeps its weights
        started = time.monotonic()
        assert shared.read_into(target, give_up_s=0.05) is None
        assert time.monotonic() - started < 1.0
    finally:
        shared._lock.release()
