"""The plan's trainer cost: the run's own on-policy update, timed on a batch of zeros shaped like the collector's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from components.trainers.dqn import DQNTrainer
from components.trainers.ppo import PPOTrainer
from components.trainers.sac import SACTrainer
from pipeline.plan.inputs import build_env
from pipeline.plan.model_spec import model_spec_for
from pipeline.plan.probes import probe_for_config
from pipeline.plan.trainer_probe import (replay_steps_per_frame, synthetic_batch, time_on_policy_update,
                                         time_replay_step)
from tests.conftest import compose

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """As the plan probes (``torch_threads``, 1 by default): with a pool per CPU, a test beside another on 2
    CPUs spun for a minute (the box-actions update took 65 s in CI) and starved its neighbour's timings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _inputs(*overrides: str):  # noqa: ANN202
    cfg = compose(*overrides)
    factory, spec = build_env(cfg)
    return cfg, factory, spec, model_spec_for(cfg).build(spec)


def test_the_plan_counts_what_the_runs_update_costs_not_only_its_optimiser_steps(monkeypatch):
    # an update that spends 40 ms a batch beyond its steps (GAE, the loss, metrics: what the stand-in misses)
    real_update = PPOTrainer.update

    def slow_update(self, batch, *, frames):  # noqa: ANN001, ANN202
        time.sleep(0.04)
        return real_update(self, batch, frames=frames)

    monkeypatch.setattr(PPOTrainer, "update", slow_update)
    cfg, factory, spec, _ = _inputs()
    costs = probe_for_config(cfg, factory, spec, cpus=2, policy_device="cpu", engine="numpy")
    per_frame = 0.04 / int(cfg.trainer.frames_per_batch)
    assert costs.trainer_s >= per_frame, f"{costs.trainer_s * 1e6:.1f} us a frame, the sleep alone is {per_frame * 1e6:.1f}"


@pytest.mark.parametrize("overrides", [
    (),  # CartPole, one minibatch per epoch
    ("trainer.minibatches=4", "env.num_envs=16"),
    ("model.rnn=lstm",),  # whole sequences from a recorded state
    ("env=classic", "env.id=Pendulum-v1"),  # Box actions
    ("env=gym", "env.id=Blackjack-v1"),  # a Tuple of Discrete observations
    ("env.factory._target_=byo_example.PickEnvFactory", "~env.factory.id", "model._target_=byo_example.SlotPolicy",
     "+model.width=16"),  # a Dict observation with an action mask, a model of the user's own
], ids=["cartpole", "minibatches", "lstm", "box-actions", "tuple-obs", "dict-mask-own-model"])
def test_the_zero_batch_feeds_every_kind_of_ppo_run(monkeypatch, overrides):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg, _, spec, model = _inputs(*overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    real_update = PPOTrainer.update

    def counted(self, batch, *, frames):  # noqa: ANN001, ANN202
        metrics = real_update(self, batch, frames=frames)
        calls.append(metrics)
        return metrics

    monkeypatch.setattr(PPOTrainer, "update", counted)
    per_frame = time_on_policy_update(cfg, model, spec, estimate_s=0.0, budget_s=0.3)
    assert per_frame is not None and 0.0 < per_frame < 0.05, "a failed update would have left the stand-in"
    assert len(calls) >= 2, "a warm-up and at least one timed update"
    # every timed update trained on every row, with all its epochs: none dropped as stale, none stopped early
    assert all(m["dropped_stale_frames"] == 0 and m["trained_frames"] == int(cfg.trainer.frames_per_batch)
               for m in calls)
    # the batch's log-probabilities are the model's when it is made: the first update's KL is ~0 (zeros in their
    # place read 0.06-0.93); later updates train on the same batch, so theirs grows (up to ~1e-3 on the Dict case)
    assert calls[0]["approx_kl"] < 1e-3, "the behaviour log-probabilities are the model's own"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the run's weights are untouched"


def test_a_replay_trainer_or_an_update_over_budget_keeps_the_stand_in(monkeypatch):
    def refuse(self, batch, *, frames):  # noqa: ANN001, ANN202
        raise AssertionError("timed an update the budget has no room for")

    monkeypatch.setattr(PPOTrainer, "update", refuse)
    cfg, _, spec, model = _inputs()  # one minibatch a pass: nothing to leave out
    assert time_on_policy_update(cfg, model, spec, estimate_s=0.2, budget_s=0.3) is None
    cfg, _, spec, model = _inputs("trainer=dqn", "replay=uniform")
    assert time_on_policy_update(cfg, model, spec, estimate_s=0.0, budget_s=0.3) is None


def test_an_update_too_long_for_the_budget_is_timed_on_fewer_minibatches_of_the_runs_size(monkeypatch):
    seen = []
    real_update = PPOTrainer.update

    def counted(self, batch, *, frames):  # noqa: ANN001, ANN202
        seen.append((self.config.minibatches, batch.numel(), int(batch["env_index"].max()) + 1))
        return real_update(self, batch, frames=frames)

    monkeypatch.setattr(PPOTrainer, "update", counted)
    cfg, _, spec, model = _inputs("trainer.minibatches=8", "trainer.frames_per_batch=1024", "env.num_envs=16")
    # the stand-in guessed 0.3 s for the whole update: 2 of its 8 minibatches fit 0.3 s twice, each up to 1.5x
    assert time_on_policy_update(cfg, model, spec, estimate_s=0.3, budget_s=0.3) is not None
    assert seen and all(s == (2, 256, 4) for s in seen), seen  # 128-row minibatches, from a quarter of the envs


def test_the_zero_batch_has_a_collectors_layout():
    _, _, spec, model = _inputs("env.num_envs=4")
    batch = synthetic_batch(spec, model, frames=10, num_envs=4)
    assert batch.batch_size == torch.Size([10])
    assert batch["env_index"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert batch["env_step"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert batch["observation"].shape == (10, 4) and batch["next", "observation"].shape == (10, 4)
    assert not batch["next", "done"].any()


def test_the_plan_counts_what_a_replay_step_costs_not_only_its_optimiser_step(monkeypatch):
    real_learn = DQNTrainer.learn

    def slow_learn(self, sample):  # noqa: ANN001, ANN202
        time.sleep(0.005)
        return real_learn(self, sample)

    monkeypatch.setattr(DQNTrainer, "learn", slow_learn)
    cfg, factory, spec, _ = _inputs("trainer=dqn", "replay=uniform")
    costs = probe_for_config(cfg, factory, spec, cpus=2, policy_device="cpu", engine="numpy")
    per_frame = 0.005 * replay_steps_per_frame(cfg.trainer)
    assert replay_steps_per_frame(cfg.trainer) == int(cfg.trainer.updates_per_batch) / int(cfg.trainer.frames_per_batch)
    assert costs.trainer_s >= per_frame, f"{costs.trainer_s * 1e6:.1f} us a frame, the sleep alone is {per_frame * 1e6:.1f}"


@pytest.mark.parametrize("overrides,trainer", [
    (("trainer=dqn", "replay=uniform"), DQNTrainer),
    (("trainer=dqn", "replay=prioritized"), DQNTrainer),
    (("trainer=sac", "replay=uniform", "env=classic", "env.id=Pendulum-v1"), SACTrainer),
], ids=["dqn-uniform", "dqn-prioritized", "sac"])
def test_a_replay_trainer_learns_from_a_buffer_of_zeros(monkeypatch, overrides, trainer):
    cfg, _, spec, model = _inputs(*overrides)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps = []
    real_learn = trainer.learn

    def counted(self, sample):  # noqa: ANN001, ANN202
        steps.append(sample.batch_size[0])
        return real_learn(self, sample)

    monkeypatch.setattr(trainer, "learn", counted)
    step = time_replay_step(cfg, model, spec, estimate_s=0.0, budget_s=0.3)
    assert step is not None and 0.0 < step < 1.0, "a failed step would have left the stand-in"
    assert len(steps) >= 2 and set(steps) == {int(cfg.trainer.batch_size)}, "a warm-up and timed steps of the run's size"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the run's weights are untouched"


def test_a_replay_step_over_budget_keeps_the_stand_in(monkeypatch):
    def refuse(self, sample):  # noqa: ANN001, ANN202
        raise AssertionError("timed a step the budget has no room for")

    monkeypatch.setattr(DQNTrainer, "learn", refuse)
    cfg, _, spec, model = _inputs("trainer=dqn", "replay=uniform")
    assert time_replay_step(cfg, model, spec, estimate_s=0.2, budget_s=0.3) is None
