"""Per-env sampling noise: an env's action depends on its observation, the weights and its own stream only."""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np
import pytest
import torch

from components.action_noise import NOISE_KEY, TABLE_STEPS, BlockNoise, rows_noise, stream_bases, uniforms
from components.collector.collector import AsyncBatchedCollector, GraphSpec
from components.envs import EnvSpec, GymEnvFactory
from components.heads import BernoulliHead, MultiCategoricalHead, epsilon_greedy, inverse_cdf
from components.inference.client import PolicyClient
from components.inference.loop import ServerConfig
from components.inference.server import InferenceServer
from components.inference.serving import NumpyActorCritic, NumpyQNetwork
from components.inference.slots import SlotTransport
from components.inference.transport import derive_layout
from components.models import ActorCritic, ModelSpec, QNetwork
from components.shm import FieldSpec

DISCRETE = EnvSpec((4,), "float32", "discrete", action_n=5)
CONTINUOUS = EnvSpec((3,), "float32", "continuous", action_shape=(2,), action_low=(-1.0, -1.0), action_high=(1.0, 1.0))
SAMPLE = np.zeros(8, np.int8)  # interaction mode 0 (random) for every row


def test_block_noise_is_the_stream_function_of_seed_and_step_across_table_refills_and_restarts():
    seeds = [11, 12, 13]
    bases = stream_bases(seeds)
    noise = BlockNoise(seeds, 3)
    for step in range(3 * TABLE_STEPS + 5):  # three refills of the table
        assert np.array_equal(noise.current(step), uniforms(bases, np.full(3, step), 3))
    assert np.array_equal(noise.current(2), uniforms(bases, np.full(3, 2), 3))  # a step behind the table: remade
    restarted = BlockNoise(seeds, 3)  # a replacement worker starts past its predecessor's steps
    assert np.array_equal(restarted.current(500), uniforms(bases, np.full(3, 500), 3))
    assert np.array_equal(rows_noise([12], [7], 3), uniforms(bases[1:2], np.array([7]), 3))


def test_uniforms_are_strictly_inside_0_1_flat_and_independent_between_envs_steps_and_columns():
    bases = stream_bases(np.arange(64))
    u = uniforms(bases, np.arange(2000)[:, None], 2)  # [steps, envs, columns]
    assert u.dtype == np.float32 and u.shape == (2000, 64, 2)
    assert u.min() > 0.0 and u.max() < 1.0
    flat = u.reshape(-1)
    counts = np.histogram(flat, bins=20, range=(0, 1))[0] / flat.size
    assert np.abs(counts - 0.05).max() < 0.002
    centred = u - 0.5
    for a, b in [(centred[1:], centred[:-1]),  # step lag
                 (centred[:, 1:], centred[:, :-1]),  # neighbouring envs (consecutive seeds)
                 (centred[..., 0], centred[..., 1])]:  # the two columns of a row
        assert abs(float((a * b).mean()) / float((centred**2).mean())) < 0.01
    assert len({tuple(row) for row in u[0]}) == 64, "every env has its own stream"


def _noise(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(uniforms(stream_bases(np.arange(rows) + seed), np.zeros(rows, np.int64), width))


@pytest.mark.parametrize("spec", [DISCRETE, CONTINUOUS], ids=["discrete", "continuous"])
def test_a_row_gets_the_same_action_in_any_batch_composition(spec):
    torch.manual_seed(0)
    model = ActorCritic(spec, hidden=(16,))
    obs = torch.randn(8, *spec.obs_shape)
    noise = _noise(8, model.action_noise_width)
    modes = torch.zeros(8, dtype=torch.int8)
    with torch.no_grad():
        full = model.act({"observation": obs, NOISE_KEY: noise}, modes)["action"]
        for rows in ([3, 0, 6], [7], [5, 4, 3, 2, 1]):
            part = model.act({"observation": obs[rows], NOISE_KEY: noise[rows]}, modes[rows])["action"]
            assert torch.allclose(part, full[rows]), f"rows {rows} served together changed their actions"
    engine = NumpyActorCritic(model, seed=0)
    served = engine.act({"observation": obs.numpy(), NOISE_KEY: noise.numpy()}, SAMPLE)["action"]
    assert np.allclose(served, full.numpy(), atol=1e-5), "the numpy engine samples as the torch model does"
    other = engine.act({"observation": obs.numpy()[::-1].copy(), NOISE_KEY: noise.numpy()[::-1].copy()},
                       SAMPLE)["action"]
    assert np.allclose(other[::-1], served, atol=1e-5)


def test_epsilon_greedy_explores_by_the_row_noise_in_torch_and_numpy_alike():
    torch.manual_seed(1)
    net = QNetwork(DISCRETE, hidden=(16,))
    net.epsilon.fill_(0.5)
    obs = torch.randn(400, 4)
    noise = _noise(400, net.action_noise_width, seed=9)
    modes = torch.zeros(400, dtype=torch.int8)
    with torch.no_grad():
        ref = net.act({"observation": obs, NOISE_KEY: noise}, modes)["action"]
        again = net.act({"observation": obs[::2], NOISE_KEY: noise[::2]}, modes[::2])["action"]
        greedy = net(obs).argmax(-1)
    assert torch.equal(again, ref[::2])
    explored = noise[:, 0] < 0.5
    assert torch.equal(ref[~explored], greedy[~explored])
    assert torch.equal(ref[explored], (noise[explored, 1] * 5).long())
    served = NumpyQNetwork(net, seed=0).act({"observation": obs.numpy(), NOISE_KEY: noise.numpy()},
                                            np.zeros(400, np.int8))["action"]
    assert np.array_equal(served, ref.numpy())


def test_masked_actions_are_never_drawn_even_at_the_extreme_uniforms():
    log_probs = torch.log_softmax(torch.tensor([[0.3, -1.0, 2.0, 0.0, 1.0]]), -1).repeat(4, 1)
    log_probs[:, [0, 4]] = float("-inf")  # the first and the last action masked
    u = torch.tensor([2.0**-25, 0.5, 1 - 2.0**-24, 1.0 - 1e-7])
    drawn = inverse_cdf(log_probs, u)
    assert set(drawn.tolist()) <= {1, 2, 3} and drawn[0] == 1 and drawn[2] == 3
    mask = torch.tensor([[False, True, False, True, True]]).repeat(4, 1)
    random = epsilon_greedy(torch.zeros(4, 5), torch.ones(()), None, mask, 0,
                            torch.stack([torch.zeros(4) + 0.1, u], 1))
    assert random.tolist() == [1, 3, 4, 4]


def test_samples_follow_the_policy_probabilities_for_every_head():
    rows = 40_000
    noise_of = lambda width: _noise(rows, width)  # noqa: E731 - rows of distinct env streams
    probs = torch.tensor([0.1, 0.2, 0.7])
    drawn = inverse_cdf(probs.log().repeat(rows, 1), noise_of(1)[:, 0])
    assert torch.allclose(torch.bincount(drawn, minlength=3) / rows, probs, atol=0.01)
    multi = MultiCategoricalHead((2, 3), (2,))
    logits = torch.tensor([0.0, 0.0, 2.0, 0.0, -2.0]).repeat(rows, 1)
    action, _ = multi.act(logits, None, noise_of(multi.noise_width))
    assert abs(action[:, 0].float().mean().item() - 0.5) < 0.015
    expected = torch.softmax(torch.tensor([2.0, 0.0, -2.0]), -1)
    assert torch.allclose(torch.bincount(action[:, 1], minlength=3) / rows, expected, atol=0.01)
    bernoulli = BernoulliHead((2,))
    bits, _ = bernoulli.act(torch.tensor([0.0, 1.5]).repeat(rows, 1), None, noise_of(2))
    assert torch.allclose(bits.float().mean(0), torch.sigmoid(torch.tensor([0.0, 1.5])), atol=0.01)
    gaussian = ActorCritic(CONTINUOUS, hidden=(8,))
    with torch.no_grad():
        gaussian.actor[-1].weight.zero_()
        gaussian.actor[-1].bias.copy_(torch.tensor([0.5, -1.0]))
        gaussian.head.log_std.copy_(torch.tensor([0.0, -1.0]))
        out = gaussian.act({"observation": torch.zeros(rows, 3), NOISE_KEY: noise_of(4)}, torch.zeros(rows))
    assert torch.allclose(out["action"].mean(0), torch.tensor([0.5, -1.0]), atol=0.02)
    assert torch.allclose(out["action"].std(0), torch.tensor([1.0, np.exp(-1.0)]).float(), atol=0.02)


def test_a_client_that_sends_no_noise_still_samples_from_its_own_rng():
    model = ActorCritic(EnvSpec((2,), "float32", "discrete", action_n=2), hidden=(4,))
    with torch.no_grad():
        model.actor[-1].weight.zero_()
        model.actor[-1].bias.zero_()  # a fair coin
    layout = derive_layout(model, FieldSpec("observation", (2,), "float32"))
    assert NOISE_KEY in [f.name for f in layout.request]
    transport = SlotTransport(layout, num_slots=1, rows_per_slot=64, ctx=threading)
    policy = PolicyClient(transport.client())
    server = InferenceServer(ModelSpec("components.models.ActorCritic", {"hidden": [4]}), transport, ServerConfig(),
                             env_spec=EnvSpec((2,), "float32", "discrete", action_n=2), template=model.state_dict())
    from tensordict import TensorDict
    with server:
        first = policy(TensorDict({"observation": torch.zeros(64, 2)}, batch_size=[64]))["action"]
        second = policy(TensorDict({"observation": torch.zeros(64, 2)}, batch_size=[64]))["action"]
    assert 10 < int(first.sum()) < 54, "a fair coin, not one action for every row"
    assert not torch.equal(first, second), "fresh draws per request"


GRAPHS = {
    "thread-thread/2": GraphSpec("thread", "thread", num_envs=6, envs_per_worker=2, chunk_len=1),
    "process-process/3": GraphSpec("process", "process", num_envs=6, envs_per_worker=3, chunk_len=4),
    "thread-inline/6": GraphSpec("thread", "inline", num_envs=6, envs_per_worker=6, chunk_len=2),
    "process-inline-concurrent/3": GraphSpec("process", "inline", num_envs=6, envs_per_worker=3, chunk_len=2,
                                             concurrent_envs=True),
}


def _actions_per_env(graph: GraphSpec, model: torch.nn.Module, spec: ModelSpec) -> dict[int, list[int]]:
    collector = AsyncBatchedCollector(GymEnvFactory("CartPole-v1"), spec, graph, frames_per_batch=60,
                                      total_frames=1200, seed=5)  # ~200 a env: > 40 each under load
    collector.update_policy_weights_(model, version=0)
    per_env: dict[int, list[tuple[int, int]]] = defaultdict(list)
    try:
        for batch in collector:
            for env, step, action in zip(batch["env_index"].tolist(), batch["env_step"].tolist(),
                                         batch["action"].tolist()):
                per_env[env].append((step, action))
    finally:
        collector.shutdown()
    return {env: [a for _, a in sorted(steps)] for env, steps in per_env.items()}


def test_every_graph_gives_each_env_the_same_actions_for_the_same_weights():
    """Different batch compositions, placements and engines; the same seed and weights: the same trajectories."""
    spec = ModelSpec("components.models.ActorCritic", {"hidden": [16]})
    torch.manual_seed(3)
    model = spec.build(EnvSpec((4,), "float32", "discrete", action_n=2))
    runs = {name: _actions_per_env(graph, model, spec) for name, graph in GRAPHS.items()}
    reference = runs.pop("thread-thread/2")
    for name, actions in runs.items():
        for env in range(6):
            n = min(len(actions[env]), len(reference[env]))
            assert n > 40, f"{name}: env {env} took {len(actions[env])} steps, the reference {len(reference[env])}"
            assert actions[env][:n] == reference[env][:n], f"{name}: env {env} got other actions"
