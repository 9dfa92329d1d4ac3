"""Batches without dense successors: the successor of every cut trajectory, exact, and PPO's values unchanged.

A collector built with ``dense_successors=False`` leaves
``("next", "observation")`` out and records the successors of the rows whose
next transition is not in the batch (episode ends, each env's last row).
The counting env's observation says where it is (episode, step, seed), so
each recorded successor is checkable; PPO must compute the same advantages
from such a batch as from the dense one.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from components.collector.collector import AsyncBatchedCollector, GraphSpec
from components.envs import EnvSpec
from components.models import ActorCritic
from components.successors import CUT_SUCCESSORS_KEY, CutSuccessors, successor_observations
from components.trainers.ppo import PPOTrainer
from tests.conftest import compose
from tests.fakes import CountingEnvFactory
from tests.test_observation_stream import GRAPHS, SMALL_MLP, _where

STREAMED = [name for name in GRAPHS if not GRAPHS[name].concurrent_envs]


def _collect_cut(graph: GraphSpec, frames_per_batch: int, total: int, nan_every: int = 0) -> list:
    factory = CountingEnvFactory(nan_every=nan_every) if nan_every else CountingEnvFactory()
    collector = AsyncBatchedCollector(factory, SMALL_MLP, graph, frames_per_batch=frames_per_batch,
                                      total_frames=total, seed=11, dense_successors=False, skip_non_finite=bool(nan_every))
    try:
        return [b.clone() for b in collector]
    finally:
        collector.shutdown()


def _cut_rows(batch: TensorDict) -> torch.Tensor:
    """Rows that ended an episode or whose env's next step is not in the batch."""
    env, step = batch["env_index"].numpy(), batch["env_step"].numpy()
    present = set(zip(env.tolist(), step.tolist()))
    follows = np.array([(e, s + 1) in present for e, s in zip(env.tolist(), step.tolist())])
    return torch.from_numpy(np.flatnonzero(batch["next", "done"].numpy() | ~follows))


@pytest.mark.parametrize("name", STREAMED)
def test_every_cut_transition_has_its_exact_successor_and_no_dense_field_is_copied(name):
    batches = _collect_cut(GRAPHS[name], frames_per_batch=23, total=230)
    assert sum(b.numel() for b in batches) == 230
    assert sum(int(b["next", "done"].sum()) for b in batches) > 20, "episodes ended at many chunk offsets"
    recorded = 0
    for batch in batches:
        assert ("next", "observation") not in batch.keys(include_nested=True)
        table = batch.get_non_tensor(CUT_SUCCESSORS_KEY)
        recorded += len(table)
        rows = _cut_rows(batch)
        successors = successor_observations(batch, rows)
        for row, successor in zip(rows.tolist(), successors):
            episode, t, seed = _where(batch["observation"][row])
            assert _where(successor) == (episode, t + 1, seed), f"row {row} of a {name} batch"
    if GRAPHS[name].chunk_len >= 4:  # a few rows per chunk piece, not every row
        assert recorded < 230 * 0.6


@pytest.mark.parametrize("name", ["process-inline", "thread-thread"])
def test_a_nan_step_cut_out_has_the_observation_acted_on_as_its_recorded_successor(name):
    batches = _collect_cut(GRAPHS[name], frames_per_batch=20, total=200, nan_every=7)
    skipped = 0
    for batch in batches:
        rows = _cut_rows(batch)
        for row, successor in zip(rows.tolist(), successor_observations(batch, rows)):
            episode, t, seed = _where(batch["observation"][row])
            if float(batch["next", "reward"][row]) == 0.0:  # cut out: back to what was acted on
                skipped += 1
                assert _where(successor) == (episode, t, seed) and bool(batch["next", "truncated"][row])
            else:
                assert _where(successor) == (episode, t + 1, seed), f"row {row} of a {name} batch"
    assert skipped >= 10


def test_successors_stay_exact_across_a_sigkilled_worker_and_its_restart():
    import os
    import signal

    graph = GRAPHS["process-inline"]
    collector = AsyncBatchedCollector(CountingEnvFactory(), SMALL_MLP, graph, frames_per_batch=23, total_frames=-1,
                                      seed=11, dense_successors=False, max_restarts=1).start()
    seeds: dict[int, set[float]] = {}

    def check(batch) -> None:  # noqa: ANN001
        rows = _cut_rows(batch)
        for row, successor in zip(rows.tolist(), successor_observations(batch, rows)):
            episode, t, seed = _where(batch["observation"][row])
            assert _where(successor) == (episode, t + 1, seed), f"row {row}"
        for env, obs in zip(batch["env_index"].tolist(), batch["observation"]):
            seeds.setdefault(env, set()).add(float(obs[2]))

    try:
        deadline = time.monotonic() + 60
        while len(seeds) < graph.num_envs and time.monotonic() < deadline:  # every env seen before the kill
            check(collector.next_batch())
        assert len(seeds) == graph.num_envs, f"envs {sorted(seeds)} delivered within 60 s"
        os.kill(collector.workers.pids[0], signal.SIGKILL)  # mid-chunk, most likely: that chunk is lost
        # until the restarted worker's envs deliver (the other worker may fill many batches meanwhile)
        deadline = time.monotonic() + 60
        while not any(len(s) > 1 for s in seeds.values()) and time.monotonic() < deadline:
            check(collector.next_batch())
        for _ in range(6):  # and some more batches after it is back
            check(collector.next_batch())
        assert collector._restarts.count == 1
    finally:
        collector.shutdown()
    assert any(len(s) > 1 for s in seeds.values()), "the restarted worker's envs were built anew (new seeds)"


def test_a_graph_without_a_stream_keeps_dense_successors():
    graph = GRAPHS["process-inline-concurrent"]
    batches = _collect_cut(graph, frames_per_batch=20, total=40)
    assert all(("next", "observation") in b.keys(include_nested=True) for b in batches)


def test_a_lookup_of_a_transition_the_table_lacks_names_it():
    table = CutSuccessors(torch.tensor([0, 1]), torch.tensor([5, 9]), torch.zeros(2, 3))
    assert table.lookup(torch.tensor([1]), torch.tensor([9])).shape == (1, 3)
    with pytest.raises(KeyError, match="env 1 step 8"):
        table.lookup(torch.tensor([0, 1]), torch.tensor([5, 8]))


def _dense_batch(n: int = 48, envs: int = 4) -> TensorDict:
    """``n`` transitions of ``envs`` envs in (step, env) order, a gap in env 2's steps, truncations and ends."""
    rng = np.random.default_rng(0)
    env = np.tile(np.arange(envs), n // envs)
    step = np.repeat(np.arange(n // envs), envs) + 100
    step[(env == 2) & (step >= 105)] += 3  # a gap: env 2's step 104 has no successor in the batch
    terminated = rng.random(n) < 0.1
    truncated = ~terminated & (rng.random(n) < 0.1)
    return TensorDict({
        "observation": torch.from_numpy(rng.normal(size=(n, 4)).astype(np.float32)),
        "action": torch.from_numpy(rng.integers(0, 2, n)),
        "sample_log_prob": torch.full((n,), -0.69),
        "state_value": torch.from_numpy(rng.normal(size=n).astype(np.float32)),
        "policy_version": torch.zeros(n, dtype=torch.long),
        "env_index": torch.from_numpy(env), "env_step": torch.from_numpy(step),
        "next": {"observation": torch.from_numpy(rng.normal(size=(n, 4)).astype(np.float32)),
                 "reward": torch.from_numpy(rng.normal(size=n).astype(np.float32)),
                 "terminated": torch.from_numpy(terminated), "truncated": torch.from_numpy(truncated),
                 "done": torch.from_numpy(terminated | truncated)},
    }, batch_size=[n])


def _cut_copy(dense: TensorDict) -> TensorDict:
    rows = _cut_rows(dense)
    cut = dense.exclude(("next", "observation"))
    cut.set_non_tensor(CUT_SUCCESSORS_KEY, CutSuccessors(dense["env_index"][rows], dense["env_step"][rows],
                                                         dense["next", "observation"][rows]))
    return cut


def _ppo() -> PPOTrainer:
    torch.manual_seed(0)
    model = ActorCritic(EnvSpec((4,), "float32", "discrete", action_n=2), hidden=(8,))
    return PPOTrainer(model, total_frames=10_000, frames_per_batch=48, minibatches=2, epochs=2)


def test_ppo_computes_the_same_advantages_and_update_from_cut_successors_as_from_dense_ones():
    dense = _dense_batch()
    cut = _cut_copy(dense)
    assert len(cut.get_non_tensor(CUT_SUCCESSORS_KEY)) < dense.numel()
    order = torch.from_numpy(np.lexsort((dense["env_step"].numpy(), dense["env_index"].numpy())))
    trainer = _ppo()
    adv_dense, ret_dense = trainer._advantages(dense[order])
    adv_cut, ret_cut = trainer._advantages(cut[order])
    assert torch.equal(adv_dense, adv_cut) and torch.equal(ret_dense, ret_cut)
    a, b = _ppo(), _ppo()
    torch.manual_seed(1)
    metrics_dense = a.update(dense, frames=48)
    torch.manual_seed(1)
    metrics_cut = b.update(cut, frames=48)
    assert metrics_dense == metrics_cut
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


FRAMES = EnvSpec((210, 160, 3), "uint8", "discrete", action_n=6)


@pytest.mark.parametrize(("overrides", "spec", "dense"), [
    ((), FRAMES, False),  # PPO: successors of cut trajectories only
    ((), EnvSpec((4,), "float32", "discrete", action_n=2), True),  # too small to be worth the bookkeeping
    (("trainer=dqn", "replay=uniform"), FRAMES, True),
    (("collector.post_collect_hook=tests.fakes.sigterm_inside_a_c_call",), FRAMES, True),
    (("collector.yield_completed_trajectories=true",), FRAMES, True),
])
def test_the_run_keeps_dense_successors_wherever_something_reads_every_row(overrides, spec, dense):
    from pipeline.plan.trainer_spec import dense_successors

    assert dense_successors(compose(*overrides), spec) is dense


def test_ppo_learns_through_python_m_pipeline_on_frames_whose_successors_are_cut(tmp_path):
    import json

    from tests.conftest import run_pipeline

    # 24x24x3 uint8 frames (1,728 bytes: cut successors), episodes truncated every 40 steps, reward for action 0
    proc = run_pipeline(["env=gym", "env.id=Frames", "~env.factory.id", "~env.factory.kwargs",
                         "env.factory._target_=pipeline.bench.frames_env.FramesEnvFactory", "+env.factory.height=24",
                         "+env.factory.width=24", "+env.factory.episode_steps=40", "model.hidden=[8]",
                         "trainer.total_frames=8192", "trainer.target_return=null", "logger=jsonl",
                         f"hydra.run.dir={tmp_path}"], tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "successors only where a trajectory is cut" in proc.stdout + proc.stderr  # the plan says so
    summary = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["frames"] == 8192
    assert summary["episode/return_mean"] > 20, summary  # a uniform policy scores 40 / 6
