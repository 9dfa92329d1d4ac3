"""A TensorDictModule as the model: wrapped, checked at plan time, served and trained like the project's own."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tensordict.nn import TensorDictModule, TensorDictSequential

from components.envs import EnvSpec
from components.model_contract import ModelContractError, check_model
from components.models import ModelSpec
from components.obs_tree import pack, packed_size, tree_leaves
from components.td_policy import TensorDictPolicy
from pipeline.plan.validate import ConfigError
from tests.conftest import compose

CARTPOLE = EnvSpec((4,), "float32", "discrete", action_n=2)


def _wrapped(module: torch.nn.Module, spec: EnvSpec = CARTPOLE) -> TensorDictPolicy:
    return TensorDictPolicy(module, spec)


def test_a_function_returning_a_tensordict_module_is_built_wrapped_and_passes_the_contract():
    model = ModelSpec("tests.fakes.tensordict_policy", {"width": 8}).build(CARTPOLE)
    assert isinstance(model, TensorDictPolicy)
    check_model(model, CARTPOLE, "ppo")
    obs = torch.randn(5, 4)
    out = model.act({"observation": obs}, torch.zeros(5, dtype=torch.int8))
    log_prob, entropy, value = model.evaluate(obs, out["action"])
    torch.testing.assert_close(log_prob, out["sample_log_prob"])
    torch.testing.assert_close(value, out["state_value"])
    torch.testing.assert_close(model.value(obs), value)
    assert (entropy > 0).all() and entropy.shape == (5,)
    (-log_prob.mean() + value.pow(2).mean()).backward()
    assert all(p.grad is not None for p in model.module.parameters()), "the loss reaches every weight of the module"
    names = set(model.state_dict())
    assert any(n.startswith("module.") for n in names) and "epsilon" in names


def test_greedy_rows_take_the_argmax_of_the_logits():
    model = ModelSpec("tests.fakes.tensordict_policy", {"width": 8}).build(CARTPOLE)
    obs = torch.randn(64, 4)
    logits = model(obs)[0]
    out = model.act({"observation": obs}, torch.ones(64, dtype=torch.int8))  # every row greedy
    assert torch.equal(out["action"], logits.argmax(-1))


def test_continuous_actions_read_loc_and_an_optional_scale():
    spec = EnvSpec((3,), "float32", "continuous", action_shape=(2,), action_low=-1.0, action_high=1.0)
    net = TensorDictModule(torch.nn.Linear(3, 4), in_keys=["observation"], out_keys=["params"])
    loc = TensorDictModule(lambda p: p[..., :2], in_keys=["params"], out_keys=["loc"])
    scale = TensorDictModule(lambda p: torch.nn.functional.softplus(p[..., 2:]) + 1e-3, in_keys=["params"],
                             out_keys=["scale"])
    with_scale = _wrapped(TensorDictSequential(net, loc, scale), spec)
    without = _wrapped(TensorDictSequential(net, loc, TensorDictModule(torch.nn.Linear(4, 1), in_keys=["params"],
                                                                       out_keys=["state_value"])), spec)
    obs = torch.randn(6, 3)
    for policy in (with_scale, without):
        out = policy.act({"observation": obs}, torch.zeros(6, dtype=torch.int8))
        assert out["action"].shape == (6, 2) and out["action"].dtype == torch.float32
    params = net(obs)
    mean, std = params[:, :2], torch.nn.functional.softplus(params[:, 2:]) + 1e-3
    out = with_scale.act({"observation": obs}, torch.zeros(6, dtype=torch.int8))
    expected = torch.distributions.Normal(mean, std).log_prob(out["action"]).sum(-1)
    torch.testing.assert_close(out["sample_log_prob"], expected)
    check_model(without, spec, "ppo")
    with pytest.raises(ModelContractError, match="writes no 'state_value'; trainer=ppo needs it"):
        check_model(with_scale, spec, "ppo")
    with pytest.raises(ModelContractError, match="trainer=sac needs an actor with sample"):
        check_model(without, spec, "sac")


def test_action_values_act_epsilon_greedily_and_masks_hold():
    spaces = pytest.importorskip("gymnasium").spaces
    space = spaces.Dict({"action_mask": spaces.MultiBinary(3), "pos": spaces.Box(-1, 1, (2,), np.float32)})
    leaves, tuples = tree_leaves(space)
    spec = EnvSpec((packed_size(leaves),), "uint8", "discrete", action_n=3, obs_kind="tree", obs_leaves=leaves,
                   obs_tuples=tuples, action_mask="action_mask")
    q = TensorDictModule(torch.nn.Linear(2, 3), in_keys=[("observation", "pos")], out_keys=["action_value"])
    policy = _wrapped(q, spec)
    check_model(policy, spec, "dqn")
    rows = [{"action_mask": np.array([0, 1, 1], np.int8), "pos": np.array([0.5, -0.5], np.float32)}] * 200
    obs = torch.from_numpy(np.stack([pack(leaves, r) for r in rows]))
    values = policy(obs)
    assert (values[:, 0] < -1e7).all(), "a masked action's value is pushed below every real one"
    policy.epsilon.fill_(1.0)
    actions = policy.act({"observation": obs}, torch.zeros(200, dtype=torch.int8))["action"]
    assert set(actions.tolist()) == {1, 2}, "exploring takes every allowed action and never the masked one"
    policy.epsilon.fill_(0.0)
    greedy = policy.act({"observation": obs}, torch.zeros(200, dtype=torch.int8))["action"]
    assert torch.equal(greedy, values.argmax(-1))
    with pytest.raises(ModelContractError, match="writes no 'logits', 'state_value'; trainer=ppo needs it"):
        check_model(policy, spec, "ppo")


def test_in_keys_the_observation_lacks_are_refused_naming_what_it_has():
    module = TensorDictModule(torch.nn.Linear(4, 2), in_keys=[("observation", "pos")], out_keys=["logits"])
    with pytest.raises(ValueError, match=r"reads 'observation/pos', which the observation does not have "
                                         r"\(it has observation\)"):
        TensorDictPolicy(module, CARTPOLE)
    with pytest.raises(ValueError, match=r"must write 'logits' \(and 'state_value'\) for trainer=ppo"):
        TensorDictPolicy(TensorDictModule(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["out"]),
                         CARTPOLE)


def test_a_tensordict_module_without_state_value_is_one_line_at_plan_time():
    from pipeline.plan import Machine
    from pipeline.plan.inputs import plan_config

    with pytest.raises(ConfigError) as err:
        plan_config(compose("model._target_=tests.fakes.tensordict_actor_only"), Machine(cpus=2, cuda=False))
    assert str(err.value) == ("model._target_='tests.fakes.tensordict_actor_only': the TensorDictModule writes "
                              "no 'state_value'; trainer=ppo needs it")


def test_a_tensordict_module_learns_cartpole_through_python_m_pipeline(tmp_path):
    from tests.conftest import run_pipeline

    run_dir = tmp_path / "run"
    proc = run_pipeline(["model._target_=tests.fakes.tensordict_policy", "+model.width=64", "workers=process",
                         "server=process", "trainer.total_frames=150000", "trainer.target_return=150",
                         "logger=jsonl", f"hydra.run.dir={run_dir}"], tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["stop_reason"] == "target_return", summary
