"""AsyncBatchedCollector: exact frame accounting on every graph, faults, pause, weights."""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import pytest
import torch

from components.collector.collector import AsyncBatchedCollector, CollectorError, GraphSpec
from components.envs import GymEnvFactory
from components.models import ModelSpec
from tests.fakes import ExplodingEnvFactory

SMALL_MLP = ModelSpec("components.models.ActorCritic", {"hidden": [16]})

GRAPHS = {
    "thread-driver-thread": GraphSpec("thread", "driver", "thread", num_envs=5, envs_per_worker=2, chunk_len=1),
    "thread-driver-thread-chunked": GraphSpec("thread", "driver", "thread", num_envs=5, envs_per_worker=2, chunk_len=3),
    "thread-driver-process": GraphSpec("thread", "driver", "process", num_envs=5, envs_per_worker=2, chunk_len=2),
    "process-slots-process": GraphSpec("process", "slots", "process", num_envs=5, envs_per_worker=2, chunk_len=4),
    "process-slots-thread": GraphSpec("process", "slots", "thread", num_envs=5, envs_per_worker=2, chunk_len=4),
    "process-driver-thread": GraphSpec("process", "driver", "thread", num_envs=5, envs_per_worker=2, chunk_len=3),
    "process-driver-process": GraphSpec("process", "driver", "process", num_envs=5, envs_per_worker=2, chunk_len=3),
    "process-slots-process-split": GraphSpec("process", "slots", "process", num_envs=7, envs_per_worker=4, chunk_len=3,
                                             splits=2),
    "thread-driver-thread-split": GraphSpec("thread", "driver", "thread", num_envs=5, envs_per_worker=5, chunk_len=2,
                                            splits=2),
}


def _collector(graph: GraphSpec, frames_per_batch: int, total_frames: int, factory=None) -> AsyncBatchedCollector:  # noqa: ANN001
    return AsyncBatchedCollector(
        factory or GymEnvFactory("CartPole-v1"), SMALL_MLP, graph,
        frames_per_batch=frames_per_batch, total_frames=total_frames, seed=3,
    )


def assert_trajectories_intact(batches: list) -> None:
    """Per env, steps arrive in order, exactly once, and each step follows the previous one."""
    per_env: dict[int, list[tuple]] = defaultdict(list)
    for batch in batches:
        for i in range(batch.numel()):
            per_env[int(batch["env_index"][i])].append((
                int(batch["env_step"][i]),
                batch["observation"][i].numpy(),
                batch["next", "observation"][i].numpy(),
                bool(batch["next", "done"][i]),
            ))
    for env, steps in per_env.items():
        assert [s[0] for s in steps] == list(range(len(steps))), f"env {env}: lost, duplicated or reordered steps"
        for (_, _, next_obs, done), (_, obs, _, _) in zip(steps, steps[1:]):
            if not done:
                assert np.array_equal(obs, next_obs), f"env {env}: a step does not follow its predecessor"


@pytest.mark.parametrize("name", list(GRAPHS))
def test_batches_are_exact_and_no_transition_is_lost_duplicated_or_reordered(name):
    graph = GRAPHS[name]
    collector = _collector(graph, frames_per_batch=37, total_frames=400)
    try:
        batches = [b.clone() for b in collector]
    finally:
        collector.shutdown()
    assert [b.numel() for b in batches] == [37] * 10 + [30], "exact batches, a shorter last one"
    assert collector.frames == 400
    envs = sorted({int(e) for b in batches for e in b["env_index"]})
    assert envs == list(range(graph.num_envs))
    assert_trajectories_intact(batches)
    stats = collector.server_stats()
    assert stats["rows"] > 0 and stats["avg_batch_size"] >= 1


def test_a_stalled_consumer_pauses_the_workers_instead_of_growing_memory():
    graph = GraphSpec("process", "slots", "thread", num_envs=4, envs_per_worker=2, chunk_len=4, chunks_per_worker=2)
    collector = _collector(graph, frames_per_batch=8, total_frames=-1).start()
    try:
        first = collector.next_batch()
        time.sleep(1.5)  # the trainer stalls
        produced = collector._control.timing[:, 4].sum()
        capacity = collector._pool.capacity_frames
        assert produced <= collector.frames + capacity
        assert collector.worker_stats()["chunk_wait_frac"] > 0.5
        batches = [first] + [collector.next_batch() for _ in range(20)]
        assert_trajectories_intact(batches)
    finally:
        collector.shutdown()


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_an_env_crash_surfaces_as_an_error_naming_the_worker(workers):
    graph = GraphSpec(workers, "slots" if workers == "process" else "driver", "thread",
                      num_envs=2, envs_per_worker=1, chunk_len=1)
    collector = _collector(graph, 16, 4000, factory=ExplodingEnvFactory(at_step=30))
    started = time.monotonic()
    with pytest.raises(CollectorError, match=r"env worker \d .*boom at step 30"):
        try:
            for _ in collector:
                pass
        finally:
            collector.shutdown()
    assert time.monotonic() - started < 30


def test_weights_pushed_mid_run_reach_the_data_with_a_new_version():
    graph = GRAPHS["thread-driver-thread"]
    collector = _collector(graph, 32, -1).start()
    try:
        first = collector.next_batch()
        assert set(first["policy_version"].tolist()) == {0}
        model = SMALL_MLP.build(collector.env_spec)
        collector.update_policy_weights_(model)
        assert collector.policy_version == 1
        versions = set()
        for _ in range(30):
            versions |= set(collector.next_batch()["policy_version"].tolist())
        assert 1 in versions and max(versions) == 1
    finally:
        collector.shutdown()
        collector.shutdown()  # idempotent


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_pause_quiesces_workers_and_resumes_without_losing_transitions(workers):
    graph = GraphSpec(workers, "slots" if workers == "process" else "driver", "thread",
                      num_envs=4, envs_per_worker=2, chunk_len=2)
    collector = _collector(graph, 24, -1).start()
    try:
        batches = [collector.next_batch() for _ in range(3)]
        with collector.pause(timeout=10):
            frozen = collector._control.timing[:, 4].sum()
            rows = collector.server_stats()["rows"]
            time.sleep(0.3)
            assert collector._control.timing[:, 4].sum() == frozen
            assert collector.server_stats()["rows"] == rows, "nothing is served while paused"
        batches += [collector.next_batch() for _ in range(3)]
        assert_trajectories_intact(batches)
    finally:
        collector.shutdown()


def test_weights_pushed_before_start_are_served_from_the_first_step():
    graph = GRAPHS["process-slots-process"]
    collector = _collector(graph, 20, 20)
    model = SMALL_MLP.build(collector.env_spec)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    collector.update_policy_weights_(model)
    try:
        (batch,) = list(collector)
    finally:
        collector.shutdown()
    assert set(batch["policy_version"].tolist()) == {1}
    assert torch.allclose(batch["state_value"], torch.zeros(20)), "zeroed weights give zero values"


class RecordingBuffer:
    """Stands in for a replay buffer: remembers every extend."""

    def __init__(self) -> None:
        self.batches: list = []

    def extend(self, batch) -> None:  # noqa: ANN001
        self.batches.append(batch.clone())

    def __len__(self) -> int:
        return sum(b.numel() for b in self.batches)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_the_writer_fills_replay_in_the_background_and_pause_holds_it(workers):
    graph = GraphSpec(workers, "slots" if workers == "process" else "driver", "thread",
                      num_envs=4, envs_per_worker=2, chunk_len=2)
    buffer = RecordingBuffer()
    collector = AsyncBatchedCollector(GymEnvFactory("CartPole-v1"), SMALL_MLP, graph, frames_per_batch=32,
                                      total_frames=32 * 40, seed=1, replay_buffer=buffer,
                                      postproc=lambda b: b[b["env_index"] >= 0])
    try:
        collector.start()
        deadline = time.monotonic() + 30
        while len(buffer.batches) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with collector.pause(timeout=10):
            written = len(buffer.batches)
            time.sleep(0.3)
            assert len(buffer.batches) == written, "no write while paused"
        with pytest.raises(RuntimeError, match="sample the buffer"):
            iter(collector).__next__()
        deadline = time.monotonic() + 60
        while collector.writing and time.monotonic() < deadline:
            time.sleep(0.02)
        collector.check_writer()
    finally:
        collector.shutdown()
    assert len(buffer) == 32 * 40 and all(b.numel() == 32 for b in buffer.batches)
    assert_trajectories_intact(buffer.batches)
