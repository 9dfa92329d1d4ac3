"""Worker restarts: a crashed, killed or hung worker is replaced with fresh envs, within a budget."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import numpy as np
import pytest
import torch

from components.collector.collector import AsyncBatchedCollector, CollectorError, GraphSpec
from components.models import ModelSpec
from tests.conftest import run_pipeline
from tests.fakes import FaultyEnvFactory

SMALL_MLP = ModelSpec("components.models.ActorCritic", {"hidden": [16]})


def _collector(graph: GraphSpec, factory, total: int, **options) -> AsyncBatchedCollector:  # noqa: ANN001
    return AsyncBatchedCollector(factory, SMALL_MLP, graph, frames_per_batch=32, total_frames=total, seed=4,
                                 **options)


def _per_env_steps(batches: list) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = defaultdict(list)
    for batch in batches:
        for e, s in zip(batch["env_index"].tolist(), batch["env_step"].tolist()):
            steps[e].append(s)
    return steps


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_crashed_worker_is_replaced_and_collection_reaches_its_budget(tmp_path, workers, capfd):
    graph = GraphSpec(workers, "thread", num_envs=4, envs_per_worker=2, chunk_len=2)
    factory = FaultyEnvFactory(at_step=40, fault="raise", once=str(tmp_path / "crashed"))
    collector = _collector(graph, factory, 32 * 30, max_restarts=2)
    try:
        batches = [b.clone() for b in collector]
    finally:
        collector.shutdown()
    assert sum(b.numel() for b in batches) == 32 * 30
    assert collector.worker_stats().get("worker_restarts", collector._restarts.count) == 1
    assert "restarted with fresh envs (1/2 within 300 s)" in capfd.readouterr().err
    steps = _per_env_steps(batches)
    assert all(len(s) == len(set(s)) for s in steps.values()), "no env step delivered twice"
    gaps = [e for e, s in steps.items() if np.any(np.diff(sorted(s)) > 1)]
    assert gaps, "the restarted envs start past a gap, which cuts their trajectories"


def test_a_sigkilled_worker_process_is_replaced():
    graph = GraphSpec("process", "thread", num_envs=4, envs_per_worker=2, chunk_len=2)
    from components.envs import GymEnvFactory

    collector = _collector(graph, GymEnvFactory("CartPole-v1"), -1, max_restarts=1).start()
    try:
        for _ in range(3):
            collector.next_batch()
        os.kill(collector.workers.pids[0], signal.SIGKILL)
        for _ in range(40):
            collector.next_batch()
        assert collector._restarts.count == 1
        os.kill(collector.workers.pids[0], signal.SIGKILL)  # the budget is spent: the next death fails
        started = time.monotonic()
        with pytest.raises(CollectorError, match=r"env worker 0 stopped unexpectedly: .*after 1 restart\(s\)"):
            for _ in range(200):
                collector.next_batch()
        assert time.monotonic() - started < 10
    finally:
        collector.shutdown()


def test_a_worker_that_keeps_crashing_fails_the_run_after_max_restarts():
    graph = GraphSpec("process", "thread", num_envs=2, envs_per_worker=2, chunk_len=2)
    collector = _collector(graph, FaultyEnvFactory(at_step=20, fault="raise"), -1, max_restarts=2).start()
    try:
        with pytest.raises(CollectorError, match=r"boom at step 20 \(after 2 restart\(s\) within 300 s; "
                                                 r"workers.max_restarts=2\)"):
            for _ in range(500):
                collector.next_batch()
        assert collector._restarts.count == 2
    finally:
        collector.shutdown()


def test_a_hung_process_worker_is_killed_and_replaced(tmp_path):
    graph = GraphSpec("process", "thread", num_envs=2, envs_per_worker=2, chunk_len=2)
    factory = FaultyEnvFactory(at_step=30, fault="hang", once=str(tmp_path / "hung"))
    collector = _collector(graph, factory, 32 * 10, max_restarts=1, step_timeout=2.0)
    try:
        started = time.monotonic()
        batches = list(collector)
        assert time.monotonic() - started < 60
    finally:
        collector.shutdown()
    assert sum(b.numel() for b in batches) == 320 and collector._restarts.count == 1


@pytest.mark.slow
def test_a_run_with_a_crashing_env_restarts_it_and_reaches_total_frames(tmp_path):
    import json

    run_dir = tmp_path / "run"
    result = run_pipeline(["env.factory._target_=tests.fakes.FaultyEnvFactory", "+env.factory.at_step=300",
                           f"+env.factory.once={tmp_path / 'marker'}", "workers=process", "env.envs_per_worker=4",
                           "transport=slots",  # no layout probe: it would step (and crash) the env first
                           "trainer.total_frames=6000", "trainer.target_return=null", "logger=jsonl",
                           "logger.interval=0.5", "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: env worker" in result.stderr and "boom at step 300" in result.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["summary"]["frames"] == 6000
    assert max(r.get("collector/worker_restarts", 0) for r in rows[:-1]) >= 1


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_sigkilled_server_process_is_restarted_with_the_latest_weights(workers, capfd):
    from components.envs import GymEnvFactory

    graph = GraphSpec(workers, "process", num_envs=4, envs_per_worker=2, chunk_len=2)
    collector = _collector(graph, GymEnvFactory("CartPole-v1"), -1, server_restarts=1).start()
    try:
        collector.update_policy_weights_(SMALL_MLP.build(collector.env_spec).state_dict(), version=7)
        before = [collector.next_batch().clone() for _ in range(5)]
        served = collector.server_stats()["rows_total"]
        os.kill(collector.server.pid, signal.SIGKILL)
        after = [collector.next_batch().clone() for _ in range(30)]
        assert collector._restarts.server_count == 1 and collector._restarts.count == 0
        assert int(after[-1]["policy_version"].min()) == 7, "the new server serves the latest weights, same label"
        assert collector.server_stats()["rows_total"] > served, "cumulative counters go on across the restart"
        steps = _per_env_steps(before + after)
        assert all(len(s) == len(set(s)) for s in steps.values()), "no env step delivered twice"
        assert all(np.any(np.diff(sorted(s)) > 1) for s in steps.values()), "every env's trajectory was cut"

        os.kill(collector.server.pid, signal.SIGKILL)  # the budget is spent: the next death fails the run
        killed = time.monotonic()
        with pytest.raises(CollectorError, match=r"^inference server \(process\) died: its process exited with "
                                                 r"code -9 \(after 1 restart\(s\); server.max_restarts=1\)"):
            for _ in range(200):
                collector.next_batch()
        assert time.monotonic() - killed < 2.0
    finally:
        collector.shutdown()
    err = capfd.readouterr().err
    assert "warning: inference server (process) restarted with the weights of version 7" in err
    assert "4 env worker(s) restarted with fresh envs" not in err and "2 env worker(s) restarted" in err


def test_without_server_restarts_a_dead_server_fails_collection_at_once():
    from components.envs import GymEnvFactory

    graph = GraphSpec("process", "process", num_envs=2, envs_per_worker=2, chunk_len=2)
    collector = _collector(graph, GymEnvFactory("CartPole-v1"), -1).start()
    try:
        collector.next_batch()
        os.kill(collector.server.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(CollectorError, match=r"^inference server \(process\) died: its process exited with "
                                                 r"code -9$"):
            for _ in range(200):
                collector.next_batch()
        assert time.monotonic() - killed < 2.0
    finally:
        collector.shutdown()


@pytest.mark.parametrize("fault", ["nan_reward", "nan_obs"])
def test_skip_non_finite_cuts_the_bad_step_out_and_counts_it(tmp_path, fault):
    graph = GraphSpec("thread", "thread", num_envs=2, envs_per_worker=2, chunk_len=2)
    factory = FaultyEnvFactory(at_step=25, fault=fault, once=str(tmp_path / "nan"))
    collector = _collector(graph, factory, 32 * 8, skip_non_finite=True)
    try:
        batches = [b.clone() for b in collector]
        skipped = collector.worker_stats()["non_finite_skipped"]
    finally:
        collector.shutdown()
    assert skipped == 1
    data = {k: torch.cat([b[k] for b in batches]) for k in ("observation", "next")}
    assert bool(torch.isfinite(data["next"]["reward"]).all())
    assert bool(torch.isfinite(data["next"]["observation"]).all())
    cut = data["next"]["truncated"] & (data["next"]["reward"] == 0)
    assert int(cut.sum()) == 1
    row = int(cut.nonzero()[0])
    assert torch.equal(data["next"]["observation"][row], data["observation"][row]), "a cut back to what was acted on"


def _after_gap(rows: list[tuple[int, int]]) -> set[int]:
    """Versions of the steps past the first gap in ``(env_step, version)`` rows: the replacement's."""
    rows = sorted(rows)
    steps = np.array([s for s, _ in rows])
    gaps = np.flatnonzero(np.diff(steps) > 1)
    return {v for _, v in rows[gaps[0] + 1:]} if gaps.size else set()


def test_a_sigkilled_worker_with_the_policy_inline_is_replaced_and_acts_with_the_latest_weights():
    """server=inline: the replacement builds a new policy copy and reads the weights published before it started."""
    from components.envs import GymEnvFactory

    graph = GraphSpec("process", "inline", num_envs=4, envs_per_worker=2, chunk_len=2)
    collector = _collector(graph, GymEnvFactory("CartPole-v1"), -1, max_restarts=1).start()
    rows: dict[int, list[tuple[int, int]]] = defaultdict(list)
    try:
        deadline = time.monotonic() + 30
        for i in range(10_000):
            if i == 3:
                os.kill(collector.workers.pids[0], signal.SIGKILL)
                collector.update_policy_weights_(SMALL_MLP.build(collector.env_spec), version=5)
            if time.monotonic() > deadline or (_after_gap(rows[0]) and _after_gap(rows[1])):
                break
            batch = collector.next_batch()
            for e, s, v in zip(batch["env_index"].tolist(), batch["env_step"].tolist(),
                               batch["policy_version"].tolist()):
                rows[e].append((s, v))
        assert collector._restarts.count == 1
        assert _after_gap(rows[0]) == {5} and _after_gap(rows[1]) == {5}
        stats = collector.server_stats()
        assert stats["policy_version"] == 5 and stats["rows_total"] > 0
    finally:
        collector.shutdown()
    assert not collector.workers.any_alive()
