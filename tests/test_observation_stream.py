"""The chunk's observation stream: each frame written once, its successor derived exactly.

Workers write an observation once, into the chunk row after the step that
produced it; the driver derives ``next.observation`` from that stream and
the finals written where episodes ended (see ``ChunkPool``). An env whose
observation says where it is (episode, step, seed) makes every transition
checkable: what was acted on, what followed, at episode ends, at chunk
boundaries, with NaN steps cut out, on every layout.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from components.collector.chunks import ChunkPool
from components.collector.collector import AsyncBatchedCollector, GraphSpec
from components.collector.worker import transition_fields
from components.models import ModelSpec
from components.shm import FieldSpec
from tests.fakes import CountingEnvFactory

SMALL_MLP = ModelSpec("components.models.ActorCritic", {"hidden": [8]})

GRAPHS = {
    # chunk_len 1: every step crosses a chunk boundary
    "thread-inline-step": GraphSpec("thread", "inline", num_envs=3, envs_per_worker=3, chunk_len=1),
    "process-inline": GraphSpec("process", "inline", num_envs=5, envs_per_worker=2, chunk_len=3),
    "process-process-split": GraphSpec("process", "process", num_envs=6, envs_per_worker=3, chunk_len=4, splits=2),
    "thread-thread": GraphSpec("thread", "thread", num_envs=4, envs_per_worker=2, chunk_len=2),
    # one chunk a worker: the stream's last row is copied into the same chunk's first
    "process-inline-one-chunk": GraphSpec("process", "inline", num_envs=8, envs_per_worker=4, chunk_len=8,
                                          chunks_per_worker=1),
    # rows in the order envs return: dense successors, no stream
    "process-inline-concurrent": GraphSpec("process", "inline", num_envs=4, envs_per_worker=2, chunk_len=3,
                                           concurrent_envs=True),
}


def _where(obs: torch.Tensor) -> tuple[int, int, int]:
    episode, step, seed = (int(v) for v in obs[:3].tolist())
    return episode, step, seed


def check_transitions(batches: list) -> int:
    """Every transition's observation and successor are what the env returned; returns the skipped count."""
    per_env: dict[int, list] = defaultdict(list)
    for batch in batches:
        assert torch.isfinite(batch["observation"]).all() and torch.isfinite(batch["next", "observation"]).all()
        for i in range(batch.numel()):
            per_env[int(batch["env_index"][i])].append(batch[i])
    skipped = 0
    for env, steps in per_env.items():
        steps.sort(key=lambda s: int(s["env_step"]))
        for k, tr in enumerate(steps):
            episode, t, seed = _where(tr["observation"])
            nxt = _where(tr["next", "observation"])
            if float(tr["next", "reward"]) == 0.0:  # a NaN step cut out: back to what was acted on
                skipped += 1
                assert nxt == (episode, t, seed) and bool(tr["next", "truncated"]), f"env {env} step {k}"
            else:
                assert nxt == (episode, t + 1, seed), f"env {env} step {k}: {nxt} after {(episode, t, seed)}"
            if k + 1 < len(steps):
                following = _where(steps[k + 1]["observation"])
                if bool(tr["next", "done"]):
                    assert following == (episode + 1, 0, seed), f"env {env}: no reset after step {k}"
                else:
                    assert following == nxt, f"env {env}: step {k + 1} does not act on step {k}'s successor"
    return skipped


def _collect(graph: GraphSpec, factory: CountingEnvFactory, frames_per_batch: int, total: int,
             skip: bool = False) -> list:
    collector = AsyncBatchedCollector(factory, SMALL_MLP, graph, frames_per_batch=frames_per_batch,
                                      total_frames=total, seed=11, skip_non_finite=skip)
    try:
        return [b.clone() for b in collector]
    finally:
        collector.shutdown()


@pytest.mark.parametrize("name", list(GRAPHS))
def test_each_transition_acts_on_what_the_env_returned_and_its_successor_is_exact(name):
    batches = _collect(GRAPHS[name], CountingEnvFactory(), frames_per_batch=23, total=230)
    assert sum(b.numel() for b in batches) == 230
    assert sum(int(b["next", "done"].sum()) for b in batches) > 20, "episodes ended at many chunk offsets"
    assert check_transitions(batches) == 0


@pytest.mark.parametrize("name", ["process-inline", "thread-thread", "process-inline-concurrent"])
def test_a_nan_step_cut_out_records_the_observation_acted_on_as_its_successor(name):
    batches = _collect(GRAPHS[name], CountingEnvFactory(nan_every=7), frames_per_batch=20, total=200, skip=True)
    assert check_transitions(batches) >= 10


def test_whole_chunks_gathered_at_once_derive_successors_across_chunks():
    # full-width workers and batches of several whole chunks: the one-gather path
    graph = GraphSpec("process", "inline", num_envs=4, envs_per_worker=2, chunk_len=2)
    batches = _collect(graph, CountingEnvFactory(size=300), frames_per_batch=16, total=160)
    assert [b.numel() for b in batches] == [16] * 10
    assert check_transitions(batches) == 0


def _filled_pool(stream: str | None) -> tuple[ChunkPool, int]:
    import threading

    obs = FieldSpec("observation", (2,), "float32")
    pool = ChunkPool(transition_fields(obs, ()), rows=[3], chunk_len=2, chunks_per_worker=1, ctx=threading,
                     stream=stream)
    chunk = pool.writer(0).acquire(timeout=1.0)
    steps = chunk["observation"].shape[0]
    chunk["observation"][:] = np.arange(steps * 3 * 2, dtype=np.float32).reshape(steps, 3, 2)
    chunk["next.done"][:] = False
    if stream:
        chunk["next.done"][1, 2] = True  # env 2 ended at step 1: its final lives apart
        chunk["next.observation"][1, 2] = -1.0
    else:
        chunk["next.observation"][:] = chunk["observation"] + 6
    return pool, 0


def test_a_stream_pool_stores_one_more_step_and_derives_the_successor_with_finals():
    pool, gid = _filled_pool("observation")
    flat = pool.flat(gid)
    assert flat["observation"].shape == (6, 2) and flat["next.observation"].shape == (6, 2)
    expected = torch.arange(6, 18, dtype=torch.float32).reshape(6, 2)
    expected[5] = -1.0
    assert torch.equal(flat["next.observation"], expected)
    out = {f.name: torch.zeros((4, *f.shape), dtype=getattr(torch, f.dtype)) for f in pool.fields}
    pool.copy_into(gid, 2, 4, out, 0)
    assert torch.equal(out["next.observation"], expected[2:6])
    assert torch.equal(out["observation"], torch.arange(4, 12, dtype=torch.float32).reshape(4, 2))


def test_a_stream_needs_its_successor_and_done_fields():
    import threading

    with pytest.raises(ValueError, match="needs the fields"):
        ChunkPool([FieldSpec("observation", (2,), "float32")], rows=[1], chunk_len=1, chunks_per_worker=1,
                  ctx=threading, stream="observation")


def test_a_gather_of_whole_chunks_patches_each_chunks_finals_where_its_episodes_ended():
    import threading

    obs = FieldSpec("observation", (2,), "float32")
    pool = ChunkPool(transition_fields(obs, ()), rows=[3, 3], chunk_len=2, chunks_per_worker=2, ctx=threading,
                     stream="observation")
    gids = []
    for worker, ends in ((0, [(0, 1), (1, 2)]), (1, []), (1, [(1, 0)]), (0, [(0, 0), (0, 2), (1, 1)])):
        writer = pool.writer(worker)
        chunk = writer.acquire(timeout=1.0)
        base = 100.0 * len(gids)
        chunk["observation"][:] = base + np.arange(3 * 3 * 2, dtype=np.float32).reshape(3, 3, 2)
        chunk["next.done"][:] = False
        for step, env in ends:  # an episode ended: its final apart, a reset's observation in the stream
            chunk["next.done"][step, env] = True
            chunk["next.observation"][step, env] = -(base + 10 * step + env)
        writer.commit()
        gids.append(pool.next_ready(timeout=1.0))
    out = {f.name: torch.zeros((24, *f.shape), dtype=getattr(torch, f.dtype)) for f in pool.fields}
    assert pool.gather_into(gids, out, 0) == 24
    expected = {f.name: torch.zeros((24, *f.shape), dtype=getattr(torch, f.dtype)) for f in pool.fields}
    for k, gid in enumerate(gids):
        pool.copy_into(gid, 0, 6, expected, 6 * k)
    for name in expected:
        assert torch.equal(out[name], expected[name]), name
    finals = out["next.observation"][out["next.done"]]
    assert finals.shape[0] == 6 and bool((finals < 0).all()), "every final patched, and only there"
