"""Workers whose envs step concurrently, one thread each (``workers.concurrent_envs``).

What they are for: no env waits for another's step. And what must not
change: every transition is whole and in order per env, a hung env among
busy ones is still caught, resets at each batch still cut every env.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict

import numpy as np
import pytest

from components.collector.collector import AsyncBatchedCollector, CollectorError, GraphSpec
from components.models import ModelSpec
from tests.test_collector import assert_trajectories_intact

SMALL_MLP = ModelSpec("components.models.ActorCritic", {"hidden": [16]})


_BUILT: dict[int, int] = {}  # envs built per process


class UnevenEnvFactory:
    """CartPole envs of which the first built in each worker process sleeps ``slow_s`` per step, the others ``fast_s``.

    Envs built in the process that made the factory (the collector's spec probe) are fast.

    ``hang_at``: that first env's step blocks for an hour from its ``hang_at``-th step (a hung simulator
    among healthy ones).
    """

    def __init__(self, slow_s: float = 0.03, fast_s: float = 0.001, hang_at: int | None = None) -> None:
        self.slow_s, self.fast_s, self.hang_at = slow_s, fast_s, hang_at
        self.owner = os.getpid()

    def __call__(self):  # noqa: ANN204
        import gymnasium as gym

        pid = os.getpid()
        first = pid != self.owner and _BUILT.get(pid, 0) == 0
        _BUILT[pid] = _BUILT.get(pid, 0) + 1
        pause, hang_at = (self.slow_s if first else self.fast_s), (self.hang_at if first else None)

        class Uneven(gym.Wrapper):
            steps = 0

            def step(self, action):  # noqa: ANN001, ANN202
                self.steps += 1
                if hang_at is not None and self.steps >= hang_at:
                    time.sleep(3600)
                time.sleep(pause)
                return self.env.step(action)

        return Uneven(gym.make("CartPole-v1"))


def _collect(graph: GraphSpec, factory, frames: int, **options) -> list:  # noqa: ANN001
    collector = AsyncBatchedCollector(factory, SMALL_MLP, graph, frames_per_batch=32, total_frames=frames, seed=1,
                                      **options)
    try:
        return [b.clone() for b in collector]
    finally:
        collector.shutdown()


@pytest.mark.parametrize("concurrent", [True, False])
def test_a_slow_env_holds_back_no_other_env_of_its_worker(concurrent):
    graph = GraphSpec("process", "inline", num_envs=4, envs_per_worker=4, chunk_len=4, concurrent_envs=concurrent)
    started = time.monotonic()
    batches = _collect(graph, UnevenEnvFactory(), 32 * 8)
    assert time.monotonic() - started < 60
    steps = Counter(int(e) for b in batches for e in b["env_index"])
    slow, fast = steps[0], min(steps[e] for e in (1, 2, 3))
    if concurrent:
        # 30 ms against 1 ms steps: the fast envs step many times per step of the slow one
        assert fast > 5 * slow, steps
    else:
        # a block steps its envs one after another: every env as often as the slowest
        assert max(steps.values()) - min(steps.values()) <= 4, steps
    assert_trajectories_intact(batches)


def test_concurrent_envs_keep_whole_transitions_per_env_across_many_chunks():
    graph = GraphSpec("process", "inline", num_envs=6, envs_per_worker=3, chunk_len=5, concurrent_envs=True)
    batches = _collect(graph, UnevenEnvFactory(slow_s=0.004, fast_s=0.0), 32 * 12)
    assert sum(b.numel() for b in batches) == 32 * 12
    assert {int(e) for b in batches for e in b["env_index"]} == set(range(6))
    assert_trajectories_intact(batches)
    versions = np.concatenate([b["policy_version"].numpy() for b in batches])
    assert set(versions.tolist()) == {0}


def test_a_hung_env_among_busy_ones_is_caught_by_the_step_watchdog():
    # the other envs of the worker keep returning, so the worker looks busy; its heartbeat is its
    # oldest unfinished step, which the watchdog sees stand still
    graph = GraphSpec("process", "inline", num_envs=3, envs_per_worker=3, chunk_len=2, concurrent_envs=True)
    started = time.monotonic()
    with pytest.raises(CollectorError, match=r"env worker 0 \(envs 0-2\) hung .*its process was killed"):
        _collect(graph, UnevenEnvFactory(slow_s=0.0, hang_at=20), -1, step_timeout=1.5, max_restarts=0,
                 stall_timeout=None)
    assert time.monotonic() - started < 30


def test_reset_at_each_iter_truncates_every_concurrent_env_once_per_batch():
    graph = GraphSpec("process", "inline", num_envs=3, envs_per_worker=3, chunk_len=2, concurrent_envs=True)
    batches = _collect(graph, UnevenEnvFactory(slow_s=0.002, fast_s=0.0), 32 * 20, reset_at_each_iter=True)
    truncations: dict[int, int] = defaultdict(int)
    for b in batches:
        for e, cut in zip(b["env_index"].tolist(), b["next", "truncated"].tolist()):
            truncations[e] += cut
    # 20 batches: each env is cut once per batch epoch it steps in, whatever its pace. A consumer
    # that falls behind (a loaded CI machine) drains a backlog of chunks as several batches while
    # an env waits for a free chunk; that env then sees those epochs as one, so fewer cuts than
    # batches are expected, but never none and never more than one per batch
    assert all(10 <= count <= 21 for count in truncations.values()), dict(truncations)
    assert set(truncations) == {0, 1, 2}
    lengths = np.concatenate([b["next", "episode_length"].numpy() for b in batches])
    assert lengths.max() < 32 * 5, "no episode outlives a few batches"


def test_a_crashed_concurrent_worker_is_replaced_and_its_envs_go_on_past_their_last_step(tmp_path):
    from tests.fakes import FaultyEnvFactory

    graph = GraphSpec("process", "inline", num_envs=3, envs_per_worker=3, chunk_len=2, concurrent_envs=True)
    factory = FaultyEnvFactory(at_step=40, once=str(tmp_path / "crashed"))
    started = time.monotonic()
    batches = _collect(graph, factory, 32 * 10, max_restarts=1)
    assert time.monotonic() - started < 60
    assert sum(b.numel() for b in batches) == 320
    per_env: dict[int, list[int]] = defaultdict(list)
    for b in batches:
        for e, s in zip(b["env_index"].tolist(), b["env_step"].tolist()):
            per_env[e].append(s)
    for env, steps in per_env.items():
        assert steps == sorted(set(steps)), f"env {env}: steps repeat or go back after the restart"
    assert any(np.diff(steps).max() > 1 for steps in per_env.values()), "the restart leaves a gap"


def test_a_hang_while_a_pause_waits_for_the_steps_in_flight_is_caught():
    graph = GraphSpec("process", "inline", num_envs=3, envs_per_worker=3, chunk_len=2, concurrent_envs=True)
    collector = AsyncBatchedCollector(UnevenEnvFactory(slow_s=0.0, hang_at=1), SMALL_MLP, graph, frames_per_batch=32,
                                      total_frames=-1, seed=1, step_timeout=1.5, max_restarts=0, stall_timeout=None)
    try:
        collector.start()
        collector.next_batch()  # envs 1 and 2 fill it; env 0 hangs in its first step
        started = time.monotonic()
        with pytest.raises(CollectorError, match=r"env worker 0 \(envs 0-2\) hung"):
            with collector.pause(timeout=20):
                pass
        assert time.monotonic() - started < 10, "caught by the step watchdog, not by the pause's own timeout"
    finally:
        collector.shutdown()
