"""Lockstep collection: the same batches, bit for bit, whatever the graph and its timing."""

from __future__ import annotations

import pytest
import torch

from components.collector.collector import AsyncBatchedCollector, GraphSpec
from components.collector.lockstep import lockstep_chunk_len, lockstep_problem
from components.envs import GymEnvFactory
from components.inference.loop import ServerConfig
from components.models import ModelSpec

SPEC = ModelSpec("components.models.ActorCritic", {"hidden": [16]})
GRAPHS = {
    "thread-thread": GraphSpec("thread", "thread", num_envs=6, envs_per_worker=2, chunk_len=1),
    "process-process": GraphSpec("process", "process", num_envs=6, envs_per_worker=3, chunk_len=4, splits=2),
    "thread-inline": GraphSpec("thread", "inline", num_envs=6, envs_per_worker=6, chunk_len=2),
    "process-inline": GraphSpec("process", "inline", num_envs=6, envs_per_worker=2, chunk_len=8),
}


def _run(graph: GraphSpec) -> list[dict[str, torch.Tensor]]:
    """Four batches of 48; between batches the weights move by a function of the batch (a stand-in trainer)."""
    collector = AsyncBatchedCollector(GymEnvFactory("CartPole-v1"), SPEC, graph, frames_per_batch=48,
                                      total_frames=192, seed=7, lockstep=True,
                                      server_config=ServerConfig(deterministic=True))
    torch.manual_seed(0)
    model = SPEC.build(collector.env_spec)
    collector.update_policy_weights_(model, version=0)
    out = []
    try:
        for k, batch in enumerate(collector):
            out.append({key: batch.get(key).clone() for key in
                        ("env_index", "env_step", "action", "sample_log_prob", "state_value", "policy_version")}
                       | {"reward": batch["next", "reward"].clone(), "obs": batch["observation"].clone()})
            with torch.no_grad():
                shift = batch["observation"].mean(0)
                next(model.parameters()).add_(shift.mean() * 0.5)
            collector.update_policy_weights_(model, version=k + 1)
    finally:
        collector.shutdown()
    return out


def test_lockstep_batches_are_fixed_in_order_and_served_by_their_own_version():
    batches = _run(GRAPHS["process-process"])
    assert len(batches) == 4
    for k, b in enumerate(batches):
        assert b["policy_version"].tolist() == [k] * 48, "every step of batch k by the weights published before it"
        assert b["env_index"].tolist() == list(range(6)) * 8, "time-major, envs in index order"
        assert b["env_step"].tolist() == [s for s in range(8 * k, 8 * k + 8) for _ in range(6)]


@pytest.mark.parametrize("name", list(GRAPHS))
def test_the_same_graph_collects_the_same_lockstep_batches_bit_for_bit(name):
    first, second = _run(GRAPHS[name]), _run(GRAPHS[name])
    for k, (a, b) in enumerate(zip(first, second, strict=True)):
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: batch {k} differs in {key}"


def test_other_graphs_give_the_same_trajectories_and_values_within_rounding():
    """Another batch shape may round a row's outputs differently (BLAS); what the envs did is the same."""
    reference = _run(GRAPHS["thread-thread"])
    for name in ("process-process", "thread-inline", "process-inline"):
        for k, (a, b) in enumerate(zip(reference, _run(GRAPHS[name]), strict=True)):
            for key in ("env_index", "env_step", "action", "reward", "obs", "policy_version"):
                assert torch.equal(a[key], b[key]), f"{name}: batch {k} differs in {key}"
            for key in ("sample_log_prob", "state_value"):
                assert torch.allclose(a[key], b[key], atol=1e-5), f"{name}: batch {k} differs in {key}"


def test_lockstep_refuses_what_it_cannot_replay_in_one_line():
    g = GraphSpec("thread", "thread", num_envs=6, envs_per_worker=3, chunk_len=4)
    assert "not a multiple of num_envs=6" in lockstep_problem(g, 50, 600, 0)
    assert "does not divide the 6 steps" in lockstep_problem(g, 36, 360, 0) and "(use 3)" in lockstep_problem(g, 36, 360, 0)
    assert "max_restarts=0" in lockstep_problem(g, 48, 480, 2)
    assert lockstep_problem(g, 48, 480, 0) is None
    assert lockstep_chunk_len(64, 8, 4) == 4 and lockstep_chunk_len(5, 12) == 4 and lockstep_chunk_len(1, 7) == 1
    with pytest.raises(ValueError, match="lockstep collection: frames_per_batch=50"):
        AsyncBatchedCollector(GymEnvFactory("CartPole-v1"), SPEC, g, frames_per_batch=50, total_frames=600,
                              lockstep=True)
