"""Collector options beyond exact batches: the stall watchdog, the chunk budget,
completed trajectories, resets at each batch, the batch hook, driver CPUs."""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from components.collector.collector import AsyncBatchedCollector, CollectorError, GraphSpec
from components.envs import GymEnvFactory
from components.models import ModelSpec
from tests.fakes import HangingEnvFactory

SMALL_MLP = ModelSpec("components.models.ActorCritic", {"hidden": [16]})


def _collector(graph: GraphSpec, frames_per_batch: int, total_frames: int, model=SMALL_MLP, factory=None,  # noqa: ANN001
               **options) -> AsyncBatchedCollector:
    return AsyncBatchedCollector(factory or GymEnvFactory("CartPole-v1"), model, graph,
                                 frames_per_batch=frames_per_batch, total_frames=total_frames, seed=5, **options)


@pytest.mark.parametrize(("what", "phrase"), [
    ("a hung env", "stepping envs"),
    ("a server that stopped answering", "waiting for actions from the inference server"),
])
def test_a_collector_that_cannot_complete_a_chunk_reports_the_stall_within_stall_timeout(what, phrase):
    graph = GraphSpec("process", "process", num_envs=2, envs_per_worker=2, chunk_len=4)
    if what == "a hung env":
        collector = _collector(graph, 16, -1, factory=HangingEnvFactory(at_step=30), stall_timeout=1.5)
    else:
        collector = _collector(graph, 16, -1, model=ModelSpec("tests.fakes.make_stalling_policy", {"answer": 12}),
                               stall_timeout=1.5)
    try:
        collector.start()
        started = time.monotonic()
        with pytest.raises(CollectorError, match=rf"collection stalled: .*worker 0 \(envs 0-1\) {phrase}"):
            for _ in range(100):
                collector.next_batch()
                started = time.monotonic()
        assert time.monotonic() - started < 1.5 + 3.0, "reported soon after stall_timeout"
    finally:
        collector.shutdown()


def test_a_slow_consumer_is_backpressure_not_a_stall():
    graph = GraphSpec("thread", "thread", num_envs=2, envs_per_worker=2, chunk_len=2)
    collector = _collector(graph, 8, -1, stall_timeout=0.5).start()
    try:
        collector.next_batch()
        time.sleep(1.5)  # the trainer is busy far longer than stall_timeout
        for _ in range(5):
            collector.next_batch()
    finally:
        collector.shutdown()


def test_a_chunk_budget_that_cannot_hold_a_batch_is_refused_up_front():
    graph = GraphSpec("thread", "thread", num_envs=8, envs_per_worker=8, chunk_len=1, chunks_per_worker=2)
    with pytest.raises(ValueError, match="chunks_per_worker=2: .* use at least 33"):
        _collector(graph, 256, 1024)


def test_completed_trajectories_are_whole_episodes_of_at_least_frames_per_batch():
    graph = GraphSpec("thread", "thread", num_envs=3, envs_per_worker=3, chunk_len=1)
    collector = _collector(graph, 40, 2000, yield_completed_trajectories=True)
    try:
        groups = [g.clone() for g in collector]
    finally:
        collector.shutdown()
    assert groups and all(g.numel() >= 40 for g in groups)
    for group in groups:
        env, step = group["env_index"].numpy(), group["env_step"].numpy()
        done, length = group["next", "done"].numpy(), group["next", "episode_length"].numpy()
        ends = np.flatnonzero(done)
        assert ends[-1] == len(done) - 1, "a group ends with a finished episode"
        first = 0
        for end in ends:
            episode = slice(first, end + 1)
            assert len(set(env[episode])) == 1, "one env per trajectory"
            assert np.array_equal(np.diff(step[episode]), np.ones(end - first, np.int64)), "consecutive steps"
            assert length[first] == 1 and length[end] == end - first + 1, "from its first step to its last"
            first = end + 1


def test_reset_at_each_iter_truncates_every_episode_after_each_batch():
    graph = GraphSpec("thread", "thread", num_envs=2, envs_per_worker=2, chunk_len=1, chunks_per_worker=5)
    longest: dict[str, int] = {}
    for reset in (False, True):
        collector = _collector(graph, 8, 8 * 80, reset_at_each_iter=reset)
        try:
            batches = [b.clone() for b in collector]
        finally:
            collector.shutdown()
        lengths = np.concatenate([b["next", "episode_length"].numpy() for b in batches])
        longest[str(reset)] = int(lengths.max())
        if reset:
            truncated = np.concatenate([b["next", "truncated"].numpy() for b in batches])
            assert truncated.sum() >= 60, "about one truncation per env per batch"
    # 4 steps per env per batch, the worker at most 5 chunks (steps) ahead: no episode outlives ~2 batches;
    # random CartPole episodes run ~22 steps on average, so without resets some are longer
    assert longest["True"] <= 14 < longest["False"], longest


def test_the_post_collect_hook_sees_every_batch_before_the_caller():
    seen: list[int] = []

    def hook(batch) -> None:  # noqa: ANN001
        seen.append(batch.numel())
        batch.set("hooked", batch["env_index"] * 0 + 1)

    graph = GraphSpec("thread", "thread", num_envs=2, envs_per_worker=2, chunk_len=1)
    collector = _collector(graph, 10, 35, post_collect_hook=hook)
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert seen == [10, 10, 10, 5] and all(bool((b["hooked"] == 1).all()) for b in batches)


def _thread_cpus(name_prefix: str) -> set[str]:
    out = set()
    for thread in threading.enumerate():
        if thread.name.startswith(name_prefix) and thread.native_id is not None:
            status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
            out.add(next(line.split(":")[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list")))
    return out


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_driver_affinity_pins_the_driver_side_threads():
    cpu = max(os.sched_getaffinity(0))
    graph = GraphSpec("thread", "thread", num_envs=2, envs_per_worker=2, chunk_len=1)
    collector = _collector(graph, 8, -1, driver_affinity=[cpu]).start()
    try:
        collector.next_batch()
        assert _thread_cpus("inference-server") == {str(cpu)}
        assert _thread_cpus("env-worker") == {str(cpu)}
        assert len(os.sched_getaffinity(0)) >= 2, "the calling thread keeps its own CPUs"
    finally:
        collector.shutdown()


def test_every_env_keeps_its_steps_in_order_with_every_option_off_and_on():
    graph = GraphSpec("process", "thread", num_envs=3, envs_per_worker=2, chunk_len=2, splits=2)
    collector = _collector(graph, 12, 240, reset_at_each_iter=True)
    try:
        per_env = defaultdict(list)
        for batch in collector:
            for e, s in zip(batch["env_index"].tolist(), batch["env_step"].tolist()):
                per_env[e].append(s)
    finally:
        collector.shutdown()
    assert all(steps == list(range(len(steps))) for steps in per_env.values())
