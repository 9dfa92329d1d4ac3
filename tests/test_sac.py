"""trainer=sac: its losses by hand on a tiny batch, the entropy coefficient, the targets, resume, and Pendulum solved."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from components.envs import EnvSpec
from components.replay.buffer import ReplayBuffer
from components.replay.storage import TensorStorage
from components.sac_models import SquashedGaussianActor, TwinQ
from components.trainers.sac import SACTrainer
from tests.conftest import run_pipeline

SPEC = EnvSpec((1,), "float32", "continuous", action_shape=(1,), action_low=(-2.0,), action_high=(2.0,))


class FixedActor(nn.Module):
    """An actor whose draw is ``a = w`` for every row, with log-probability ``log_pi``: numbers to compute by hand."""

    def __init__(self, w: float, log_pi: float) -> None:
        super().__init__()
        self.spec = SPEC
        self.w = nn.Parameter(torch.tensor(w))
        self.log_pi = log_pi

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w.expand(obs.shape[0], 1), torch.full((obs.shape[0],), self.log_pi)

    def act(self, inputs, modes=None):
        return {"action": self.w.detach().expand(inputs["observation"].shape[0], 1)}


def _linear_critics(twin: TwinQ, rows: list[tuple[float, float, float]]) -> None:
    """Q_i(s, a) = ws_i * s + wa_i * a + b_i (no hidden layer)."""
    with torch.no_grad():
        for i, (ws, wa, b) in enumerate(rows):
            twin.weights[0][i] = torch.tensor([[ws], [wa]])
            twin.biases[0][i] = torch.tensor([[b]])


def _trainer(**hyper) -> SACTrainer:
    hyper = {"critic_hidden": [], "gamma": 0.5, "alpha": 0.5, "autotune": False, **hyper}
    trainer = SACTrainer(FixedActor(1.0, -0.4), **hyper)
    _linear_critics(trainer.critic, [(1.0, 2.0, 0.0), (0.5, 1.0, 1.0)])
    _linear_critics(trainer.critic_target, [(2.0, 0.0, 0.0), (1.0, 1.0, 0.0)])
    return trainer


def _batch() -> TensorDict:
    return TensorDict({"observation": torch.tensor([[1.0], [2.0]]), "action": torch.tensor([[0.5], [-1.0]]),
                       ("next", "observation"): torch.tensor([[3.0], [0.0]]), ("next", "reward"): torch.tensor([1.0, -1.0]),
                       ("next", "terminated"): torch.tensor([False, True])}, [2])


def test_the_critic_loss_is_the_twin_squared_error_against_the_soft_target_by_hand():
    trainer = _trainer()
    loss, q, td_abs = trainer.critic_loss(_batch())
    # next action 1.0, log pi -0.4, alpha 0.5: row 0 targets 2*3=6 and 3+1=4 -> min 4, soft 4 + 0.2 = 4.2,
    # target 1 + 0.5 * 4.2 = 3.1; row 1 is terminal: target -1
    target = torch.tensor([3.1, -1.0])
    q1 = torch.tensor([1.0 + 2 * 0.5, 2.0 - 2.0])           # Q1 = s + 2a
    q2 = torch.tensor([0.5 + 0.5 + 1.0, 1.0 - 1.0 + 1.0])   # Q2 = 0.5 s + a + 1
    expected = ((target - q1) ** 2).mean() + ((target - q2) ** 2).mean()
    assert torch.allclose(q, torch.stack([q1, q2]))
    assert math.isclose(float(loss), float(expected), rel_tol=1e-6)
    assert torch.allclose(td_abs, torch.maximum((target - q1).abs(), (target - q2).abs()))
    # n-step rows discount by gamma ** n, and importance weights scale each row's error
    batch = _batch()
    batch["next", "n_steps"] = torch.tensor([2, 1])
    batch["weight"] = torch.tensor([0.5, 2.0])
    loss, _, _ = trainer.critic_loss(batch)
    target = torch.tensor([1 + 0.25 * 4.2, -1.0])
    w = torch.tensor([0.5, 2.0])
    expected = (w * (target - q1) ** 2).mean() + (w * (target - q2) ** 2).mean()
    assert math.isclose(float(loss), float(expected), rel_tol=1e-6)


def test_the_actor_loss_is_alpha_log_pi_minus_the_smaller_q_by_hand():
    trainer = _trainer()
    loss, log_pi = trainer.actor_loss(torch.tensor([[1.0], [2.0]]))
    # a = 1: Q1 = s + 2, Q2 = 0.5 s + 2 -> min is Q2 for s > 0: 2.5 and 3.0
    assert math.isclose(float(loss), 0.5 * -0.4 - (2.5 + 3.0) / 2, rel_tol=1e-6)
    assert torch.equal(log_pi, torch.tensor([-0.4, -0.4]))
    loss.backward()
    # d/dw of -(mean of 0.5 s + w + 1) = -1: only through the action
    assert math.isclose(float(trainer.model.w.grad), -1.0, rel_tol=1e-6)


def test_the_squashed_log_probability_matches_the_change_of_variables():
    torch.manual_seed(0)
    actor = SquashedGaussianActor(SPEC, hidden=(8,))
    obs = torch.randn(5, 1)
    eps = torch.randn(5, 1)
    action, log_prob = actor.sample(obs, noise=eps)
    mean, log_std = actor(obs)
    z = mean + log_std.exp() * eps
    normal = torch.distributions.Normal(mean, log_std.exp())
    expected = (normal.log_prob(z) - torch.log(2.0 * (1 - torch.tanh(z) ** 2) + 1e-6)).sum(-1)
    assert torch.allclose(log_prob, expected, atol=1e-5)
    assert torch.allclose(action, 2.0 * torch.tanh(z)) and bool(action.abs().max() <= 2.0)
    greedy = actor.act({"observation": obs}, torch.ones(5, dtype=torch.int8))["action"]
    assert torch.allclose(greedy, 2.0 * torch.tanh(mean)), "evaluation acts the squashed mean"


@pytest.mark.parametrize("log_pi, direction", [(5.0, +1), (-5.0, -1)])
def test_the_entropy_coefficient_moves_toward_its_target(log_pi, direction):
    # target entropy -1: log pi = 5 is an entropy of -5, below it (alpha must grow); -5 is above (alpha shrinks)
    trainer = SACTrainer(FixedActor(0.0, log_pi), critic_hidden=[4], autotune=True, alpha=0.2, alpha_lr=0.01)
    assert trainer.target_entropy == -1.0
    before = float(trainer.alpha)
    for _ in range(20):
        trainer._step(trainer.alpha_optimizer, [trainer.log_alpha],
                      trainer.alpha_loss(torch.full((4,), log_pi)), "alpha loss")
    after = float(trainer.alpha)
    assert (after - before) * direction > 0.01, (before, after)


def test_target_critics_move_by_exactly_tau():
    trainer = SACTrainer(SquashedGaussianActor(SPEC, hidden=(8,)), critic_hidden=[8], tau=0.25)
    with torch.no_grad():
        for p in trainer.critic.parameters():
            p.add_(torch.randn_like(p))
    old = [p.clone() for p in trainer.critic_target.parameters()]
    trainer.update_targets()
    for before, online, after in zip(old, trainer.critic.parameters(), trainer.critic_target.parameters()):
        assert torch.allclose(after, before + 0.25 * (online - before), atol=1e-7, rtol=0)
        assert not torch.equal(after, before)


def _filled_buffer(rows: int) -> ReplayBuffer:
    buffer = ReplayBuffer(TensorStorage(1000), seed=1)
    g = torch.Generator().manual_seed(0)
    buffer.extend(TensorDict({
        "observation": torch.randn(rows, 1, generator=g), "action": torch.rand(rows, 1, generator=g) * 4 - 2,
        ("next", "observation"): torch.randn(rows, 1, generator=g), ("next", "reward"): torch.randn(rows, generator=g),
        ("next", "terminated"): torch.zeros(rows, dtype=torch.bool), "policy_version": torch.zeros(rows, dtype=torch.int64),
    }, [rows]))
    return buffer


def test_updates_follow_the_rows_written_and_never_run_ahead_of_them():
    trainer = SACTrainer(SquashedGaussianActor(SPEC, hidden=(8,)), critic_hidden=[8], batch_size=16,
                         learning_starts=100, updates_per_frame=0.5)
    buffer = _filled_buffer(64)
    trainer.update(buffer, frames=64)
    assert trainer.updates == 0, "before learning_starts nothing is owed"
    buffer.extend(_filled_buffer(64).storage.get(torch.arange(64)))  # 128 rows: 29 past learning_starts (100)
    trainer.update(buffer, frames=128)
    assert trainer.updates == 14 and trainer.credit == pytest.approx(0.5)
    buffer.extend(_filled_buffer(64).storage.get(torch.arange(64)))
    metrics = trainer.update(buffer, frames=192)
    assert trainer.updates == 14 + 32 and metrics["steps_per_batch"] == 32.0
    assert trainer.policy_version == 3, "one version per call, as DQN"
    assert trainer.updates <= 0.5 * (buffer.written - 100 + 1)


def test_a_prioritized_replay_gets_the_worse_critics_td_errors_and_the_stale_filter_applies():
    trainer = SACTrainer(SquashedGaussianActor(SPEC, hidden=(8,)), critic_hidden=[8], batch_size=16,
                         learning_starts=0, updates_per_frame=0.25)
    buffer = ReplayBuffer(TensorStorage(1000), sampler="prioritized", max_policy_lag=0, seed=1)
    buffer.extend(_filled_buffer(64).storage.get(torch.arange(64)))
    trainer.update(buffer, frames=64)
    assert trainer.updates == 16
    priorities = buffer.state_dict()["priorities"][:64]
    assert (priorities != priorities[0]).any(), "sampled rows got their |TD error| as priority"
    with pytest.raises(RuntimeError, match="max_policy_lag"):  # every row is version 0, the learner is at 1
        buffer.extend(_filled_buffer(8).storage.get(torch.arange(8)))
        trainer.update(buffer, frames=72)


def test_a_resumed_trainer_and_replay_continue_bit_identically():
    torch.manual_seed(0)
    first = SACTrainer(SquashedGaussianActor(SPEC, hidden=(16,)), critic_hidden=[16], batch_size=16, learning_starts=0)
    buffer = _filled_buffer(200)
    first.update(buffer, frames=200)
    stream = io.BytesIO()  # through the bytes of a checkpoint, as a resume reads them
    torch.save({"trainer": first.state_dict(), "replay": buffer.state_dict()}, stream)
    stream.seek(0)
    saved = torch.load(stream, weights_only=True)
    saved_trainer, saved_buffer = saved["trainer"], saved["replay"]
    second = SACTrainer(SquashedGaussianActor(SPEC, hidden=(16,)), critic_hidden=[16], batch_size=16, learning_starts=0)
    second.load_state_dict(saved_trainer)
    restored = ReplayBuffer(TensorStorage(1000), seed=99)
    restored.load_state_dict(saved_buffer)
    assert restored.written == 200 and torch.equal(restored.storage.get(torch.arange(200))["action"],
                                                    buffer.storage.get(torch.arange(200))["action"])
    obs = torch.randn(7, 1)
    modes = torch.ones(7, dtype=torch.int8)
    assert torch.equal(first.model.act({"observation": obs}, modes)["action"],
                       second.model.act({"observation": obs}, modes)["action"])
    for trainer, replay in ((first, buffer), (second, restored)):  # the same next steps: same samples, same weights
        torch.manual_seed(5)
        more = _filled_buffer(50).storage.get(torch.arange(50))
        replay.extend(more)
        trainer.update(replay, frames=250)
    for a, b in zip([*first.model.parameters(), *first.critic.parameters(), first.log_alpha],
                    [*second.model.parameters(), *second.critic.parameters(), second.log_alpha]):
        assert torch.equal(a, b)


PENDULUM = ["env=classic", "trainer=sac", "trainer.total_frames=12288", "trainer.target_return=-200",
            "logger=jsonl", "progress=false", "seed=1", "model.hidden=[64,64]", "trainer.critic_hidden=[64,64]",
            "torch_threads=1"]  # two test processes share the 2 CI cores


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["workers=thread"], ["workers=process", "server=process", "transport=slots"]])
def test_sac_solves_pendulum(layout, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_pipeline([*PENDULUM, *layout, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["stop_reason"] == "target_return", summary
    assert summary["episode/return_mean"] >= -200
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    for key in ("model", "critic", "critic_target", "actor_optimizer", "critic_optimizer", "alpha_optimizer",
                "log_alpha", "replay"):
        assert checkpoint.get(key) is not None, key
    assert checkpoint["replay"]["written"] == len(checkpoint["replay"]["storage"]["data"][0]) > 0


@pytest.mark.parametrize("args, message", [
    (["trainer=sac"], "trainer=sac: env.id='CartPole-v1' has Discrete actions; SAC needs continuous (Box) ones"),
    (["env=classic", "trainer=sac", "trainer.updates_per_frame=0"], "trainer.updates_per_frame=0"),
    (["env=classic", "trainer=sac", "trainer.tau=0"], "trainer.tau=0.0: must be in (0, 1]"),
    (["env=classic", "trainer=sac", "trainer.tau=1.5"], "trainer.tau=1.5: must be in (0, 1]"),
    (["env=classic", "trainer=sac", "replay=none"], "trainer=sac needs a replay buffer"),
])
def test_bad_sac_input_is_one_line(args, message, tmp_path):
    proc = run_pipeline([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("limit, saved", [(None, True), (0, False)])
def test_a_memory_replay_is_in_the_checkpoint_while_it_fits_its_stated_size(limit, saved, tmp_path):
    """Every off-policy trainer (DQN here): a resumed run samples the replay the killed one had."""
    run_dir = tmp_path / "run"
    extra = [] if limit is None else [f"replay.checkpoint_max_mb={limit}"]
    proc = run_pipeline(["trainer=dqn", "replay=uniform", "trainer.total_frames=2048", "trainer.learning_starts=512",
                         "trainer.updates_per_batch=4", "trainer.target_return=null", "logger=jsonl", "progress=false",
                         *extra, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    if saved:
        replay = checkpoint["replay"]
        assert replay["written"] >= 2048 - 3 * 8 and replay["storage"]["size"] == replay["written"]
        assert replay["storage"]["data"][0].shape[0] == replay["storage"]["size"]
        assert "checkpoint_max_mb" not in proc.stderr
    else:
        assert "replay" not in checkpoint
        assert "replay.checkpoint_max_mb=0: checkpoints no longer hold them" in proc.stderr
