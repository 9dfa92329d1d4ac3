"""The policy inside an env worker (server=inline): what it answers in each interaction mode."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from components.action_noise import NOISE_KEY
from components.envs import EnvSpec
from components.inference.inline import InlinePolicy
from components.inference.inline_stats import InlineStatsTable
from components.inference.serving import NumpyActorCritic, NumpyQNetwork
from components.interaction import InteractionMode
from components.models import ActorCritic, QNetwork

SPEC = EnvSpec((4,), "float32", "discrete", action_n=3)


class _SpyEngine:
    """Records the modes each call got, answering with the wrapped engine."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine, self.modes = engine, []

    def act(self, inputs, modes=None):  # noqa: ANN001, ANN201
        self.modes.append(modes)
        return self.engine.act(inputs, modes)


def _policy(engine) -> InlinePolicy:  # noqa: ANN001
    return InlinePolicy(0, None, SPEC, "numpy", SimpleNamespace(seq=0), InlineStatsTable(1, 0), seed=0
                        ).built_with(engine)


@pytest.mark.parametrize("kind", ["actor_critic", "q"])
@pytest.mark.parametrize("mode", list(InteractionMode), ids=[m.name for m in InteractionMode])
def test_a_blocks_answer_is_the_engines_with_every_row_in_the_blocks_mode(kind, mode):
    # a block's rows share one mode: when every row samples the engine is handed no mode rows (it need not look
    # for greedy ones); the answer must be what the engine gives with the mode spelled out row by row
    torch.manual_seed(0)
    if kind == "actor_critic":
        engine = NumpyActorCritic(ActorCritic(SPEC, hidden=(16,)), seed=0)
    else:
        net = QNetwork(SPEC, hidden=(16,))
        net.epsilon.fill_(0.5)  # half the sampling rows explore: the modes decide which may
        engine = NumpyQNetwork(net, seed=0)
    spy = _SpyEngine(engine)
    rng = np.random.default_rng(1)
    obs = rng.normal(size=(12, 4)).astype(np.float32)
    noise = rng.uniform(0.01, 0.99, (12, 2)).astype(np.float32)
    got = _policy(spy).act(obs, 12, int(mode), noise)
    want = engine.act({"observation": obs, NOISE_KEY: noise}, np.full(12, int(mode), np.int8))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert got["policy_version"].tolist() == [0] * 12
    if mode == InteractionMode.RANDOM:
        assert spy.modes == [None]
    else:
        assert spy.modes[0].tolist() == [int(mode)] * 12
