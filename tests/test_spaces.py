"""Every flat gymnasium space: specs, one-hot inputs, action heads, collection in every placement, learning."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from components.collector.collector import AsyncBatchedCollector, GraphSpec
from components.envs import EnvConfigError, EnvSpec
from components.heads import BernoulliHead, MultiCategoricalHead
from components.models import ActorCritic, ModelSpec, QNetwork
from components.obs_input import ONE_HOT_MAX, ObservationInput
from pipeline.plan.validate import ConfigError
from tests.conftest import compose
from tests.fakes import MatchEnv, MatchEnvFactory


class _Spaces:
    def __init__(self, observation_space, action_space) -> None:  # noqa: ANN001
        self.observation_space, self.action_space = observation_space, action_space


@pytest.mark.parametrize(("obs", "act", "want"), [
    (gym.spaces.Discrete(16), gym.spaces.Discrete(4), dict(obs_kind="discrete", obs_nvec=(16,), obs_shape=())),
    (gym.spaces.MultiDiscrete([[2, 3], [4, 5]], start=[[1, 0], [0, 2]]), gym.spaces.MultiDiscrete([3, 2]),
     dict(obs_kind="multi_discrete", obs_nvec=(2, 3, 4, 5), obs_start=(1, 0, 0, 2), obs_shape=(2, 2),
          action_kind="multi_discrete", action_nvec=(3, 2), action_dtype="int64")),
    (gym.spaces.MultiBinary(5), gym.spaces.MultiBinary([2, 2]),
     dict(obs_kind="multi_binary", obs_dtype="int8", action_kind="multi_binary", action_shape=(2, 2),
          action_dtype="int8")),
])
def test_specs_read_every_flat_space(obs, act, want):
    spec = EnvSpec.from_env(_Spaces(obs, act))
    for key, value in want.items():
        assert getattr(spec, key) == value, key
    obs_space, act_space = spec.spaces()
    assert type(obs_space) is type(obs) and type(act_space) is type(act)
    assert obs_space.contains(spec.zero_observation()) and act_space.contains(spec.zero_actions(1)[0])


@pytest.mark.parametrize("space", [gym.spaces.Text(8), gym.spaces.Sequence(gym.spaces.Discrete(3)),
                                   gym.spaces.Graph(gym.spaces.Box(0, 1, (2,)), None)])
def test_a_space_the_pipeline_cannot_carry_is_one_line_naming_it_and_what_is_supported(space):
    with pytest.raises(EnvConfigError) as err:
        EnvSpec.from_env(_Spaces(space, gym.spaces.Discrete(2)))
    message = str(err.value)
    assert "\n" not in message and type(space).__name__ in message
    assert "Box, Discrete, MultiDiscrete or MultiBinary observations" in message
    with pytest.raises(EnvConfigError, match="start=1 is not supported"):
        EnvSpec.from_env(_Spaces(gym.spaces.Discrete(3), gym.spaces.Discrete(2, start=1)))


def test_categorical_observations_are_one_hot_per_component_and_embedded_past_the_limit():
    spec = EnvSpec.from_env(_Spaces(gym.spaces.MultiDiscrete([2, 3], start=[1, 0]), gym.spaces.Discrete(2)))
    features = ObservationInput(spec)(torch.tensor([[1, 0], [2, 2]]))
    assert features.tolist() == [[1, 0, 1, 0, 0], [0, 1, 0, 0, 1]]
    big = EnvSpec.from_env(_Spaces(gym.spaces.Discrete(ONE_HOT_MAX + 1), gym.spaces.Discrete(2)))
    embedded = ObservationInput(big)
    assert embedded.embedding is not None and embedded(torch.tensor([0, ONE_HOT_MAX])).shape == (2, embedded.out_dim)
    model = ActorCritic(spec, hidden=(8,))
    assert model.actor[0][0].in_features == 5, "the MLP reads the one-hot, not the raw numbers"
    assert QNetwork(spec, hidden=(8,))(torch.tensor([[1, 0]])).shape == (1, 2)
    with pytest.raises(ValueError, match="observations are categories"):
        ActorCritic(spec, obs_norm=True)


def test_the_multi_categorical_head_is_the_sum_of_its_components():
    head = MultiCategoricalHead([2, 3], (2,))
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.0, -1.0]])
    action = torch.tensor([[1, 0]])
    log_prob, entropy = head.evaluate(logits, action)
    first, second = torch.log_softmax(logits[0, :2], 0), torch.log_softmax(logits[0, 2:], 0)
    assert log_prob.item() == pytest.approx((first[1] + second[0]).item(), abs=1e-6)
    hand = -(first.exp() * first).sum() - (second.exp() * second).sum()
    assert entropy.item() == pytest.approx(hand.item(), abs=1e-6)
    greedy, greedy_log_prob = head.act(logits, torch.tensor([True]))
    assert greedy.tolist() == [[1, 0]] and greedy_log_prob.item() == pytest.approx(log_prob.item(), abs=1e-6)
    torch.manual_seed(0)
    samples, _ = head.act(logits.expand(4000, -1), None)
    share = (samples[:, 1] == 0).float().mean().item()
    assert share == pytest.approx(second.exp()[0].item(), abs=0.03), "each component sampled from its own softmax"


def test_the_bernoulli_head_samples_flags_and_scores_them():
    head = BernoulliHead((2,))
    logits = torch.tensor([[2.0, -1.0]])
    action = torch.tensor([[1, 1]], dtype=torch.int8)
    log_prob, entropy = head.evaluate(logits, action)
    p = torch.sigmoid(logits[0])
    assert log_prob.item() == pytest.approx((torch.log(p[0]) + torch.log(p[1])).item(), abs=1e-6)
    hand = -(p * p.log() + (1 - p) * (1 - p).log()).sum()
    assert entropy.item() == pytest.approx(hand.item(), abs=1e-6)
    greedy, _ = head.act(logits, torch.tensor([True]))
    assert greedy.dtype == torch.int8 and greedy.tolist() == [[1, 0]]
    torch.manual_seed(0)
    samples, _ = head.act(logits.expand(4000, -1), None)
    assert samples[:, 0].float().mean().item() == pytest.approx(p[0].item(), abs=0.03)


@pytest.mark.parametrize(("obs", "act"), [("multi_discrete", "multi_discrete"), ("multi_binary", "multi_binary"),
                                          ("discrete", "multi_discrete")])
def test_the_actor_critic_acts_in_the_action_space_and_evaluates_what_it_sampled(obs, act):
    env = MatchEnv(obs, act)
    spec = EnvSpec.from_env(env)
    model = ActorCritic(spec, hidden=(16,))
    first, _ = env.reset(seed=1)
    rows = torch.as_tensor(np.stack([np.asarray(first)] * 3))
    out = model.act({"observation": rows}, torch.zeros(3, dtype=torch.int8))
    assert out["action"].shape == (3, *spec.action_shape)
    assert all(env.action_space.contains(a) for a in out["action"].numpy().astype(spec.action_dtype))
    log_prob, entropy, value = model.evaluate(rows, out["action"])
    assert torch.allclose(log_prob, out["sample_log_prob"], atol=1e-5) and entropy.shape == value.shape == (3,)


PLACEMENTS = {
    "thread/thread": GraphSpec("thread", "thread", num_envs=4, envs_per_worker=4),
    "thread/inline": GraphSpec("thread", "inline", num_envs=4, envs_per_worker=4),
    "process/process": GraphSpec("process", "process", num_envs=4, envs_per_worker=2, chunk_len=4),
    "process/inline": GraphSpec("process", "inline", num_envs=4, envs_per_worker=2, chunk_len=4),
}


def collect(factory, model_spec, graph, seed: int = 4) -> list:  # noqa: ANN001
    """96 transitions in batches of 32 through ``graph``; the collector is shut down whatever happens."""
    collector = AsyncBatchedCollector(factory, model_spec, graph, frames_per_batch=32, total_frames=96, seed=seed).start()
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert sum(b.numel() for b in batches) == 96
    return batches


@pytest.mark.parametrize(("placement", "obs", "act"), [
    *((p, o, a) for p in PLACEMENTS for o, a in [("discrete", "multi_discrete")]),
    ("thread/thread", "multi_discrete", "multi_discrete"), ("process/inline", "multi_discrete", "multi_discrete"),
    ("thread/inline", "multi_binary", "multi_binary"), ("process/process", "multi_binary", "multi_binary"),
])
def test_every_flat_space_is_collected_in_every_placement_intact(placement, obs, act):
    """The env raises on an action off its space, so a wrong dtype or range from any placement fails the run."""
    factory = MatchEnvFactory(obs, act)
    spec = EnvSpec.from_env(factory())
    batches = collect(factory, ModelSpec("components.models.ActorCritic", {"hidden": [8]}), PLACEMENTS[placement])
    for batch in batches:
        assert batch["observation"].shape[1:] == spec.obs_shape and batch["action"].shape[1:] == spec.action_shape
        assert str(batch["action"].dtype).endswith(spec.action_dtype)
        low, high = np.asarray(spec.obs_start or [0]), np.asarray(spec.obs_start or [0]) + np.asarray(spec.obs_nvec or [2])
        observations = batch["observation"].numpy().reshape(batch.numel(), -1)
        assert ((observations >= low) & (observations < high)).all()
        per_env = batch["next", "episode_length"].numpy()
        assert per_env.min() >= 1 and per_env.max() <= 8


def test_an_observation_outside_its_categories_is_the_envs_spec_violation_named():
    from components.collector.env_block import EnvBlock

    class Broken(MatchEnv):
        def _obs(self):  # noqa: ANN202
            return 99 if self._t == 2 else super()._obs()

    block = EnvBlock(lambda: Broken("discrete"), [7], [0])
    obs = np.zeros(1, np.int64)
    block.reset(obs)
    rows = block.empty_rows()
    block.step(np.zeros((1, 3), np.int64), rows, obs)
    with pytest.raises(ValueError, match=r"env 7 broke its spec at its step 2: its observation 99 is outside"):
        block.step(np.zeros((1, 3), np.int64), rows, obs)


def test_dqn_on_multi_discrete_actions_is_one_line(tmp_path):
    from tests.conftest import run_pipeline

    proc = run_pipeline(["env.factory._target_=tests.fakes.MatchEnvFactory", "~env.factory.id", "trainer=dqn",
                         "replay=uniform", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith("has MultiDiscrete actions; DQN needs Discrete ones (use trainer=ppo)")


@pytest.mark.parametrize(("obs", "act", "random_return"), [("discrete", "multi_discrete", 8.0),
                                                           ("multi_binary", "multi_binary", 12.0)])
def test_ppo_learns_a_task_of_categorical_observations_and_factorised_actions(tmp_path, obs, act, random_return):
    """Copy the observation into the action: random play scores 8 (12 with flags), the best 24."""
    import json

    from tests.conftest import run_pipeline

    run_dir = tmp_path / "run"
    proc = run_pipeline(["env.factory._target_=tests.fakes.MatchEnvFactory", "~env.factory.id",
                         f"+env.factory.obs={obs}", f"+env.factory.act={act}", "trainer.total_frames=40000",
                         "trainer.target_return=21", "logger=jsonl", "workers=thread", "server=inline",
                         f"hydra.run.dir={run_dir}"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["stop_reason"] == "target_return", summary
    assert summary["episode/return_mean"] >= 21 > random_return * 1.5


def test_frozenlake_learns_with_one_hot_cells(tmp_path):
    """FrozenLake-v1 4x4 (not slippery): the cell is a category. Measured: 4.9k frames with one-hot and the CartPole
    defaults, 32.5k before one-hot; 32.8k with the toy-text preset env=gym now applies (2048-frame updates)."""
    import json

    from tests.conftest import run_pipeline

    run_dir = tmp_path / "run"
    proc = run_pipeline(["env=gym", "env.id=FrozenLake-v1", "+env.factory.kwargs.is_slippery=false",
                         "trainer.target_return=0.95", "trainer.total_frames=100000", "logger=jsonl", "workers=thread",
                         "server=inline", f"hydra.run.dir={run_dir}"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "engine auto -> torch: the env's categorical observations" in proc.stdout
    assert "preset    specialize/ppo_toy_text.yaml" in proc.stdout
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["stop_reason"] == "target_return", summary
    assert not math.isnan(summary["episode/return_mean"])


def test_taxi_learns_with_one_hot_cells_its_info_mask_and_the_toy_text_preset(tmp_path):
    """Taxi-v4 (500 cells, info["action_mask"]): the CartPole defaults stayed at -200 for 1M frames; the toy-text
    preset reaches its target of 7.0 (the optimum is about 8) in ~95k frames, ~30 s on 2 CPUs."""
    import json

    from tests.conftest import run_pipeline

    run_dir = tmp_path / "run"
    proc = run_pipeline(["env=gym", "env.id=Taxi-v4", "logger=jsonl", f"hydra.run.dir={run_dir}"], tmp_path,
                        timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "masks     info['action_mask'] of every reset and step" in proc.stdout, proc.stdout
    assert "preset    specialize/ppo_toy_text.yaml" in proc.stdout and "env=gym runs as env=toy_text" in proc.stdout
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["stop_reason"] == "target_return" and summary["episode/return_mean"] >= 7.0, summary


# ------------------------------------------------------------------ your own model
CARTPOLE = EnvSpec((4,), "float32", "discrete", action_n=2)


def test_the_contract_check_names_what_a_model_lacks_or_returns_wrong():
    from components.model_contract import ModelContractError, accepted_kwargs, check_model
    from tests.fakes import NoEvaluateModel, TinyActorCritic, WrongShapeModel

    check_model(TinyActorCritic(CARTPOLE), CARTPOLE, "ppo")
    check_model(ActorCritic(CARTPOLE), CARTPOLE, "ppo")
    check_model(QNetwork(CARTPOLE), CARTPOLE, "dqn")
    with pytest.raises(ModelContractError, match=r"NoEvaluateModel has no evaluate method\(s\); trainer=ppo calls"):
        check_model(NoEvaluateModel(CARTPOLE), CARTPOLE, "ppo")
    with pytest.raises(ModelContractError, match=r"WrongShapeModel.act returned action of shape \(2, 1\); expected \(2,\)"):
        check_model(WrongShapeModel(CARTPOLE), CARTPOLE, "ppo")
    with pytest.raises(ModelContractError, match="has no epsilon buffer"):
        check_model(TinyActorCritic(CARTPOLE), CARTPOLE, "dqn")
    wrong_obs = EnvSpec((5,), "float32", "discrete", action_n=2)
    with pytest.raises(ModelContractError, match=r"TinyActorCritic failed on a batch of 2 observations of shape \(5,\): "
                                                 r"RuntimeError: mat1 and mat2"):
        check_model(TinyActorCritic(CARTPOLE), wrong_obs, "ppo")
    common = {"encoder", "hidden"}
    assert accepted_kwargs(TinyActorCritic, {"encoder": "mlp", "hidden": [8], "width": 4}, common) == {"width": 4}
    assert accepted_kwargs(TinyActorCritic, {"widht": 4}, common) == {"widht": 4}, "a misspelt key is passed, and fails"


@pytest.mark.parametrize("placement", [["workers=thread", "server=thread"], ["workers=process", "server=process"],
                                       ["workers=process", "server=inline"]], ids=["thread", "process", "inline"])
def test_a_model_of_your_own_trains_in_every_placement(tmp_path, placement):
    import json

    from tests.conftest import run_pipeline

    run_dir = tmp_path / "run"
    proc = run_pipeline(["model._target_=tests.fakes.TinyActorCritic", "+model.width=32", *placement,
                         "trainer.total_frames=2048", "trainer.target_return=null", "logger=jsonl",
                         f"hydra.run.dir={run_dir}"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "engine auto -> torch: tests.fakes.TinyActorCritic has no numpy copy" in proc.stdout
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["frames"] == 2048 and summary["stop_reason"] == "total_frames"


@pytest.mark.parametrize(("overrides", "line"), [
    (["model._target_=tests.fakes.WrongShapeModel"],
     "model._target_='tests.fakes.WrongShapeModel': WrongShapeModel.act returned action of shape (2, 1); expected (2,)"),
    (["model._target_=tests.fakes.TinyActorCritic", "+model.widht=32"],
     "model._target_='tests.fakes.TinyActorCritic': TypeError: "),
    (["model._target_=tests.fakes.NoSuchModel"], "model._target_='tests.fakes.NoSuchModel': cannot import it"),
])
def test_a_wrong_model_is_one_line_when_the_config_is_planned(overrides, line):
    from pipeline.plan import Machine
    from pipeline.plan.inputs import plan_config

    with pytest.raises(ConfigError) as err:
        plan_config(compose(*overrides), Machine(cpus=2, cuda=False))
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


@pytest.mark.parametrize(("overrides", "line"), [
    (["model._target_=tests.fakes.NoEvaluateModel"],
     "model._target_='tests.fakes.NoEvaluateModel': NoEvaluateModel has no evaluate method(s); trainer=ppo calls"),
    # before the plan's probes build the trainer (a Hydra traceback and exit 1 before)
    (["trainer._target_=tests.fakes.NoSuchTrainer"], "trainer._target_='tests.fakes.NoSuchTrainer': cannot import it"),
])
def test_a_wrong_model_is_one_line_before_any_process_starts(tmp_path, overrides, line):
    from tests.conftest import run_pipeline

    proc = run_pipeline([*overrides, "workers=process", "server=process", f"hydra.run.dir={tmp_path / 'run'}"],
                        tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("config error: " + line), proc.stderr[-2000:]
    assert "plan:" not in proc.stdout or "env-worker" not in proc.stderr


@pytest.mark.parametrize(("obs", "act"), [("multi_discrete", "multi_discrete"), ("multi_binary", "multi_binary")])
def test_evaluation_plays_factorised_actions(obs, act):
    """Greedy evaluation hands each env its action row (an int() of it used to fail)."""
    from pipeline.runner.evaluation import Evaluator

    factory = MatchEnvFactory(obs, act)
    model = ActorCritic(EnvSpec.from_env(factory()), hidden=(8,))
    evaluator = Evaluator(factory, model, episodes=3, seed=1)
    try:
        assert evaluator.start(model.state_dict(), version=4, frames=100)
        evaluator.wait(30)
        result = evaluator.poll()
    finally:
        evaluator.close()
    assert result is not None and result["episodes"] == 3 and result["length_mean"] == 8
    assert 0 <= result["return_mean"] <= 24 and result["policy_version"] == 4
