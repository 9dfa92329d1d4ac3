"""Actor-critic models: the served ``act`` and the trainer's ``evaluate``."""

from __future__ import annotations

import torch

from components.envs import EnvSpec
from components.interaction import InteractionMode
from components.models import ActorCritic, ModelSpec

CARTPOLE = EnvSpec((4,), "float32", "discrete", action_n=2)


def test_act_returns_action_logprob_value_per_row():
    model = ActorCritic(CARTPOLE)
    out = model.act({"observation": torch.randn(5, 4)}, torch.zeros(5, dtype=torch.int8))
    assert out["action"].shape == (5,) and out["action"].dtype == torch.int64
    assert out["sample_log_prob"].shape == (5,) and out["state_value"].shape == (5,)
    log_prob, _, value = model.evaluate(torch.zeros(5, 4), out["action"])
    assert log_prob.shape == (5,) and value.shape == (5,)


def test_greedy_rows_take_the_argmax_and_random_rows_sample():
    torch.manual_seed(0)
    model = ActorCritic(EnvSpec((4,), "float32", "discrete", action_n=3))
    with torch.no_grad():
        model.actor[-1].bias.copy_(torch.tensor([0.0, 0.5, 0.0]))
    obs = torch.zeros(400, 4)
    modes = torch.full((400,), int(InteractionMode.RANDOM), dtype=torch.int8)
    modes[:200] = int(InteractionMode.DETERMINISTIC)
    action = model.act({"observation": obs}, modes)["action"]
    assert (action[:200] == 1).all(), "deterministic rows must act greedily"
    assert len(set(action[200:].tolist())) == 3, "random rows must explore"


def test_gaussian_head_log_prob_matches_torch_distributions():
    spec = EnvSpec((3,), "float32", "continuous", action_shape=(2,), action_low=(-1.0, -1.0), action_high=(1.0, 1.0))
    model = ActorCritic(spec, hidden=(8,), init_log_std=-0.5)
    out = model.act({"observation": torch.randn(6, 3)}, torch.zeros(6, dtype=torch.int8))
    mean, _ = model(torch.zeros(6, 3))
    log_prob, entropy, _ = model.evaluate(torch.zeros(6, 3), out["action"])
    dist = torch.distributions.Normal(mean, model.head.log_std.exp())
    assert torch.allclose(log_prob, dist.log_prob(out["action"]).sum(-1), atol=1e-5)
    assert torch.allclose(entropy, dist.entropy().sum(-1), atol=1e-5)


def test_nature_cnn_takes_uint8_frame_stacks():
    spec = EnvSpec((4, 84, 84), "uint8", "discrete", action_n=6)
    model = ModelSpec("components.models.ActorCritic", {"encoder": "nature_cnn"}).build(spec)
    obs = torch.randint(0, 255, (2, 4, 84, 84), dtype=torch.uint8)
    out = model.act({"observation": obs}, torch.zeros(2, dtype=torch.int8))
    assert out["action"].shape == (2,) and int(out["action"].max()) < 6
