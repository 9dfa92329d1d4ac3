"""AsyncBatchedCollector: exact frame accounting on every graph, faults, pause, weights."""

from __future__ import annotations

import os
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
    "thread-thread": GraphSpec("thread", "thread", num_envs=5, envs_per_worker=2, chunk_len=1),
    "thread-thread-chunked": GraphSpec("thread", "thread", num_envs=5, envs_per_worker=2, chunk_len=3),
    "thread-process": GraphSpec("thread", "process", num_envs=5, envs_per_worker=2, chunk_len=2),
    "process-process": GraphSpec("process", "process", num_envs=5, envs_per_worker=2, chunk_len=4),
    "process-thread": GraphSpec("process", "thread", num_envs=5, envs_per_worker=2, chunk_len=4),
    "process-thread-chunk3": GraphSpec("process", "thread", num_envs=5, envs_per_worker=2, chunk_len=3),
    "process-process-split": GraphSpec("process", "process", num_envs=7, envs_per_worker=4, chunk_len=3,
                                             splits=2),
    "thread-thread-split": GraphSpec("thread", "thread", num_envs=5, envs_per_worker=5, chunk_len=2,
                                            splits=2),
    "thread-inline": GraphSpec("thread", "inline", num_envs=5, envs_per_worker=2, chunk_len=1),
    "process-inline": GraphSpec("process", "inline", num_envs=5, envs_per_worker=2, chunk_len=4),
    # every env in its own thread, rows in completion order; 5 envs in workers of 3 and 2 (a narrower one)
    "process-inline-concurrent": GraphSpec("process", "inline", num_envs=5, envs_per_worker=3, chunk_len=4,
                                           concurrent_envs=True),
    "process-process-concurrent": GraphSpec("process", "process", num_envs=5, envs_per_worker=3, chunk_len=2,
                                            concurrent_envs=True),
    "thread-thread-concurrent": GraphSpec("thread", "thread", num_envs=4, envs_per_worker=4, chunk_len=3,
                                          concurrent_envs=True),
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
    graph = GraphSpec("process", "thread", num_envs=4, envs_per_worker=2, chunk_len=4, chunks_per_worker=2)
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


@pytest.mark.parametrize(("workers", "concurrent"), [("thread", False), ("process", False), ("process", True)])
def test_an_env_crash_surfaces_as_an_error_naming_the_worker(workers, concurrent):
    graph = GraphSpec(workers, "thread", num_envs=2, envs_per_worker=1 + concurrent, chunk_len=1,
                      concurrent_envs=concurrent)
    collector = _collector(graph, 16, 4000, factory=ExplodingEnvFactory(at_step=30))
    started = time.monotonic()
    # concurrent envs: the worker's line names the env whose thread raised
    expected = (r"env worker 0 \(envs 0-1\) failed: env \d raised RuntimeError: boom at step 30" if concurrent
                else r"env worker \d .*boom at step 30")
    with pytest.raises(CollectorError, match=expected):
        try:
            for _ in collector:
                pass
        finally:
            collector.shutdown()
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("name", ["thread-thread", "process-process", "thread-inline", "process-inline",
                                  "process-inline-concurrent"])
def test_weights_pushed_mid_run_reach_the_data_with_the_version_they_were_given(name):
    collector = _collector(GRAPHS[name], 32, -1).start()
    try:
        first = collector.next_batch()
        assert set(first["policy_version"].tolist()) == {0}, "version 0 is the initial weights"
        model = SMALL_MLP.build(collector.env_spec)
        assert collector.update_policy_weights_(model, version=7) == 7
        versions: set[int] = set()
        for _ in range(60):
            versions |= set(collector.next_batch()["policy_version"].tolist())
            if 7 in versions:
                break
        assert versions <= {0, 7} and 7 in versions
        assert collector.policy_version == 7
        assert collector.update_policy_weights_(model) == 8, "no version given: the last one + 1"
    finally:
        collector.shutdown()
        collector.shutdown()  # idempotent


@pytest.mark.parametrize(("workers", "concurrent"), [("thread", False), ("process", False), ("process", True)])
def test_pause_quiesces_workers_and_resumes_without_losing_transitions(workers, concurrent):
    graph = GraphSpec(workers, "thread", num_envs=4, envs_per_worker=2, chunk_len=2, concurrent_envs=concurrent)
    collector = _collector(graph, 24, -1).start()
    try:
        batches = [collector.next_batch() for _ in range(3)]
        with collector.pause(timeout=10):
            frozen = collector._control.timing[:, 4].sum()
            collector.server_stats()  # closes the interval
            time.sleep(0.3)
            assert collector._control.timing[:, 4].sum() == frozen
            assert collector.server_stats()["rows"] == 0, "nothing is served while paused"
        batches += [collector.next_batch() for _ in range(3)]
        assert_trajectories_intact(batches)
    finally:
        collector.shutdown()


@pytest.mark.parametrize("name", ["process-process", "process-inline"])
def test_weights_pushed_before_start_are_served_from_the_first_step(name):
    graph = GRAPHS[name]
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
    assert set(batch["policy_version"].tolist()) == {1}, "the version the weights were pushed with (default: 0 + 1)"
    assert torch.allclose(batch["state_value"], torch.zeros(20)), "zeroed weights give zero values"


@pytest.mark.parametrize("server", ["thread", "process", "inline"])
def test_initial_weights_pushed_as_version_0_are_stamped_0_and_an_initial_version_carries_through(server):
    graph = GraphSpec("thread", server, num_envs=4, envs_per_worker=4, chunk_len=1)
    collector = _collector(graph, 16, 16)
    collector.update_policy_weights_(SMALL_MLP.build(collector.env_spec), version=0)
    try:
        (batch,) = list(collector)
    finally:
        collector.shutdown()
    assert set(batch["policy_version"].tolist()) == {0}
    resumed = AsyncBatchedCollector(GymEnvFactory("CartPole-v1"), SMALL_MLP, graph, frames_per_batch=16,
                                    total_frames=16, policy_version=41)
    try:
        (batch,) = list(resumed)
    finally:
        resumed.shutdown()
    assert set(batch["policy_version"].tolist()) == {41}


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
    graph = GraphSpec(workers, "thread",
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


PLACEMENTS = {
    "thread-workers-thread-server": GraphSpec("thread", "thread", num_envs=4, envs_per_worker=2, chunk_len=2),
    "thread-workers-process-server": GraphSpec("thread", "process", num_envs=4, envs_per_worker=2, chunk_len=2),
    "process-workers-thread-server": GraphSpec("process", "thread", num_envs=4, envs_per_worker=2,
                                               chunk_len=2, splits=2),
    "process-workers-process-server": GraphSpec("process", "process", num_envs=4, envs_per_worker=2,
                                                chunk_len=2, splits=2),
    "thread-workers-inline": GraphSpec("thread", "inline", num_envs=4, envs_per_worker=2, chunk_len=2),
    "process-workers-inline": GraphSpec("process", "inline", num_envs=4, envs_per_worker=2, chunk_len=2, splits=2),
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_server_statistics_of_an_interval_equal_the_rows_the_workers_sent_in_it(name):
    collector = _collector(PLACEMENTS[name], 24, -1).start()
    requested = collector._control.timing[:, 5]
    try:
        for _ in range(2):
            collector.next_batch()
        with collector.pause(timeout=10):  # every request in flight is answered while parked
            collector.server_stats()
            before = requested.sum()
        for _ in range(5):
            collector.next_batch()
        time.sleep(0.2)
        with collector.pause(timeout=10):
            stats = collector.server_stats()
            sent = requested.sum() - before
        assert sent > 0 and stats["rows"] == sent, (stats["rows"], sent)
        assert stats["rows_total"] >= stats["rows"] and stats["requests"] > 0
        assert stats["avg_batch_size"] == pytest.approx(stats["rows"] / stats["batches"])
    finally:
        collector.shutdown()


def _loads_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as fh:
        return "libtorch" in fh.read()


@pytest.mark.parametrize(("engine", "torch_in_workers"), [
    ("numpy", False),  # weights as numpy arrays through the lock-free reader: no torch in the worker
    ("torch", True),
])
def test_inline_workers_import_torch_only_for_the_torch_engine(engine, torch_in_workers):
    from components.inference.loop import ServerConfig

    graph = GraphSpec("process", "inline", num_envs=2, envs_per_worker=1, chunk_len=4)
    collector = AsyncBatchedCollector(GymEnvFactory("CartPole-v1"), SMALL_MLP, graph, frames_per_batch=16,
                                      total_frames=-1, seed=0, server_config=ServerConfig(engine=engine)).start()
    try:
        model = SMALL_MLP.build(collector.env_spec)
        collector.update_policy_weights_(model, version=3)
        versions: set[int] = set()
        for _ in range(100):
            versions |= set(collector.next_batch()["policy_version"].tolist())
            if 3 in versions:
                break
        assert 3 in versions
        assert _loads_torch(os.getpid()), "the driver has torch"
        assert [_loads_torch(pid) for pid in collector.workers.pids] == [torch_in_workers] * 2
    finally:
        collector.shutdown()


def test_inline_blocks_larger_than_max_batch_size_are_evaluated_in_slices():
    from components.inference.loop import ServerConfig

    graph = GraphSpec("thread", "inline", num_envs=5, envs_per_worker=5, chunk_len=1)
    collector = AsyncBatchedCollector(GymEnvFactory("CartPole-v1"), SMALL_MLP, graph, frames_per_batch=20,
                                      total_frames=-1, seed=0, server_config=ServerConfig(max_batch_size=2)).start()
    try:
        collector.server_stats()
        batches = [collector.next_batch() for _ in range(3)]
        with collector.pause(timeout=10):
            stats = collector.server_stats()
    finally:
        collector.shutdown()
    assert_trajectories_intact(batches)
    assert stats["batches"] == 3 * stats["requests"], "5 rows in passes of 2, 2 and 1"
    assert stats["avg_batch_size"] == pytest.approx(5 / 3)


def _closure_factory(env_id: str):  # noqa: ANN202 - a factory no plain pickle can carry
    import gymnasium as gym

    return lambda: gym.make(env_id)


@pytest.mark.parametrize("factory", [lambda: __import__("gymnasium").make("CartPole-v1"), _closure_factory("CartPole-v1")],
                         ids=["lambda", "closure"])
def test_a_lambda_or_closure_factory_runs_in_process_workers(factory):
    import pickle

    with pytest.raises(Exception):
        pickle.dumps(factory)  # what failed before: workers got the factory by plain pickle
    collector = _collector(GraphSpec("process", "thread", num_envs=4, envs_per_worker=2, chunk_len=4), 32, 64,
                           factory=factory).start()
    try:
        batches = [batch for batch in collector]
    finally:
        collector.shutdown()
    assert sum(b.numel() for b in batches) == 64
    assert_trajectories_intact(batches)


def test_portable_keeps_importable_factories_as_they_are_and_names_what_cannot_travel():
    import socket

    from components.portable import portable

    plain = GymEnvFactory("CartPole-v1")
    assert portable(plain) is plain
    sock = socket.socket()
    try:
        with pytest.raises(TypeError, match="cannot be sent to a process worker"):
            portable(lambda: sock)
    finally:
        sock.close()
