"""Replay storage, sum tree and buffer: what must hold for a trainer to trust its samples."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from tensordict import TensorDict

from components.replay.buffer import ReplayBuffer
from components.replay.storage import TensorStorage
from components.replay.sumtree import SumTree
from tests.conftest import sample_while_writing


def rows(start: int, n: int, version: int = 0) -> TensorDict:
    """``n`` transitions numbered ``start..start+n-1``; every field is a function of the number."""
    ids = torch.arange(start, start + n)
    return TensorDict({
        "id": ids,
        "observation": ids.float().unsqueeze(-1).expand(n, 4).clone(),
        "policy_version": torch.full((n,), version, dtype=torch.int64),
        "next": {"observation": (ids + 1).float().unsqueeze(-1).expand(n, 4).clone(), "reward": ids.float() * 0.5},
    }, [n])


def assert_consistent(batch: TensorDict) -> None:
    """Every field of every row belongs to the same transition (no torn or foreign rows)."""
    ids = batch["id"].float()
    assert torch.equal(batch["observation"], ids.unsqueeze(-1).expand(-1, 4))
    assert torch.equal(batch["next", "observation"], (ids + 1).unsqueeze(-1).expand(-1, 4))
    assert torch.equal(batch["next", "reward"], ids * 0.5)


# -- storage --------------------------------------------------------------------------------------
def test_storage_overwrites_the_oldest_rows_once_full() -> None:
    s = TensorStorage(10)
    assert s.extend(rows(0, 7)).tolist() == list(range(7))
    assert s.extend(rows(7, 7)).tolist() == [7, 8, 9, 0, 1, 2, 3]  # wraps around the end
    assert len(s) == 10 and s.cursor == 4
    got = s.get(torch.arange(10))
    assert got["id"].tolist() == [10, 11, 12, 13, 4, 5, 6, 7, 8, 9]
    assert_consistent(got)


def test_storage_batch_larger_than_capacity_equals_row_by_row_extends() -> None:
    whole, single = TensorStorage(5), TensorStorage(5)
    whole.extend(rows(0, 3))
    single.extend(rows(0, 3))
    whole.extend(rows(3, 12))
    for i in range(3, 15):
        single.extend(rows(i, 1))
    assert whole.cursor == single.cursor and len(whole) == len(single) == 5
    assert torch.equal(whole.get(range(5))["id"], single.get(range(5))["id"])


def test_storage_rejects_batches_that_do_not_match_the_layout() -> None:
    s = TensorStorage(8)
    s.extend(rows(0, 2))
    with pytest.raises(KeyError, match="missing"):
        s.extend(rows(0, 2).exclude("id"))
    bad = rows(0, 2)
    bad["observation"] = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="observation"):
        s.extend(bad)
    with pytest.raises(ValueError, match="one batch dimension"):
        s.extend(rows(0, 4).reshape(2, 2))
    with pytest.raises(IndexError):
        s.get([2])  # only rows 0 and 1 exist


def test_memory_storage_state_dict_carries_the_rows() -> None:
    s = TensorStorage(6)
    s.extend(rows(0, 9))
    t = TensorStorage(6)
    t.load_state_dict(s.state_dict())
    assert (t.cursor, len(t)) == (s.cursor, len(s))
    assert torch.equal(t.get(range(6))["id"], s.get(range(6))["id"])


def test_disk_storage_reopened_from_state_dict_has_identical_contents(tmp_path) -> None:
    s = TensorStorage(16, path=tmp_path / "rb")
    s.extend(rows(0, 21))
    assert (tmp_path / "rb" / "next" / "observation.memmap").exists()
    torch.save(s.state_dict(), tmp_path / "state.pt")
    before = s.get(range(16))
    del s
    t = TensorStorage(16, path=tmp_path / "rb")
    t.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    after = t.get(range(16))
    assert (before == after).all()
    assert_consistent(after)
    t.extend(rows(100, 2))  # and it keeps going from the same cursor
    assert t.get([5, 6])["id"].tolist() == [100, 101]


def test_memory_state_dict_cannot_be_mistaken_for_a_disk_one(tmp_path) -> None:
    s = TensorStorage(4, path=tmp_path)
    s.extend(rows(0, 2))
    with pytest.raises(ValueError, match="disk storage"):
        TensorStorage(4).load_state_dict(s.state_dict())


# -- sum tree -------------------------------------------------------------------------------------
def test_sumtree_find_matches_a_cumulative_sum_search() -> None:
    rng = np.random.default_rng(0)
    tree = SumTree(37)
    values = rng.random(37) * (rng.random(37) > 0.3)  # some absent leaves
    tree.update(np.arange(37), values)
    tree.update([3, 3, 5], [0.0, 2.0, 0.0])  # last duplicate wins
    values[3], values[5] = 2.0, 0.0
    assert tree.total == pytest.approx(values.sum())
    assert tree.min == pytest.approx(values[values > 0].min())
    prefix = rng.random(1000) * values.sum()
    expected = np.searchsorted(np.cumsum(values), prefix, side="right")
    assert np.array_equal(tree.find(prefix), expected)
    assert (values[tree.find([0.0, values.sum()])] > 0).all()  # the ends never land on absent leaves


@pytest.mark.parametrize("fanout", [2, 4, 16])
@pytest.mark.parametrize("capacity", [1, 17, 5000])
def test_a_wide_sumtree_agrees_with_a_cumulative_sum_at_every_depth(capacity: int, fanout: int) -> None:
    rng = np.random.default_rng(capacity + fanout)
    tree = SumTree(capacity, fanout=fanout)
    values = np.zeros(capacity)
    for _ in range(20):  # batched updates with duplicates and absent (0) leaves
        idx = rng.integers(0, capacity, 64)
        new = rng.random(64) * (rng.random(64) > 0.4)
        tree.update(idx, new)
        for i, v in zip(idx, new):
            values[i] = v  # the last duplicate wins
    if values.sum() == 0:
        tree.update([0], [1.0])
        values[0] = 1.0
    assert tree.total == pytest.approx(values.sum())
    assert tree.min == pytest.approx(values[values > 0].min())
    prefix = np.concatenate([rng.random(2000) * values.sum(), [0.0, values.sum(), 2 * values.sum()]])
    found = tree.find(prefix)
    assert (values[found] > 0).all(), "never an absent leaf, not even at or past the end"
    inside = prefix[:-2]
    assert np.array_equal(found[:-2], np.searchsorted(np.cumsum(values), inside, side="right"))
    assert found[-1] == found[-2] == np.flatnonzero(values)[-1], "at or past the end: the last leaf with mass"
    rebuilt = SumTree(capacity, fanout=fanout)
    rebuilt.set_all(values)
    assert np.array_equal(rebuilt.find(inside), found[:-2])


def test_sumtree_rejects_bad_values_and_shapes() -> None:
    tree = SumTree(8)
    for bad in ([-1.0], [np.nan], [np.inf]):
        with pytest.raises(ValueError, match="finite and >= 0"):
            tree.update([0], bad)
    with pytest.raises(ValueError, match="2 indices but 3 values"):
        tree.update([0, 1], [1.0, 2.0, 3.0])
    with pytest.raises(IndexError):
        tree.update([8], [1.0])
    with pytest.raises(ValueError, match="power of two"):
        SumTree(8, fanout=3)


def test_sumtree_rebuild_equals_incremental_updates() -> None:
    values = np.random.default_rng(1).random(100)
    a, b = SumTree(100), SumTree(100)
    for i, v in enumerate(values):
        a.update([i], [v])
    b.set_all(values)
    assert a.total == pytest.approx(b.total) and a.min == b.min
    assert np.array_equal(a.find(np.linspace(0, a.total * 0.999, 50)), b.find(np.linspace(0, a.total * 0.999, 50)))


# -- uniform and prioritized sampling -------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_sampling_returns_only_stored_rows(sampler: str) -> None:
    rb = ReplayBuffer(TensorStorage(50), sampler=sampler, seed=3)
    rb.extend(rows(0, 30))
    batch = rb.sample(500)
    assert batch.batch_size == torch.Size([500])
    assert (batch["index"] < 30).all() and torch.equal(batch["index"], batch["id"])
    assert_consistent(batch)
    assert set(batch["id"].tolist()) == set(range(30))
    assert batch["weight"].dtype == torch.float32
    if sampler == "uniform":
        assert (batch["weight"] == 1).all()


def test_prioritized_sampling_frequencies_follow_p_to_the_alpha() -> None:
    alpha = 0.6
    rb = ReplayBuffer(TensorStorage(10), sampler="prioritized", alpha=alpha, seed=0)
    rb.extend(rows(0, 10))
    td = np.arange(1, 11, dtype=np.float64)
    rb.update_priorities(np.arange(10), td)
    counts = np.bincount(rb.sample(20_000)["index"].numpy(), minlength=10)
    p = (td + rb.eps) ** alpha
    expected = 20_000 * p / p.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 27.88  # chi-square, 9 degrees of freedom, p = 0.001


def test_importance_weights_match_a_hand_computation() -> None:
    alpha, beta = 0.5, 0.4
    rb = ReplayBuffer(TensorStorage(8), sampler="prioritized", alpha=alpha, beta=beta, eps=0.0 + 1e-6, seed=1)
    rb.extend(rows(0, 4))
    rb.update_priorities([0, 1, 2, 3], [1.0, -4.0, 9.0, 16.0])  # |td| counts
    batch = rb.sample(64)
    p = (np.array([1.0, 4.0, 9.0, 16.0]) + 1e-6) ** alpha
    prob = p / p.sum()
    w = (4 * prob) ** -beta
    expected = w / w.max()
    assert np.allclose(batch["weight"].numpy(), expected[batch["index"].numpy()], rtol=1e-6)
    assert batch["weight"].max() <= 1.0


def test_a_nan_td_error_is_refused_and_leaves_the_priorities_alone() -> None:
    rb = ReplayBuffer(TensorStorage(10), sampler="prioritized", seed=0)
    rb.extend(rows(0, 4))
    before = rb._tree.values.copy()
    with pytest.raises(ValueError, match="td errors must be finite"):
        rb.update_priorities([0, 1], [1.0, float("nan")])
    assert np.array_equal(rb._tree.values, before)


def test_priority_updates_change_what_is_sampled() -> None:
    rb = ReplayBuffer(TensorStorage(100), sampler="prioritized", alpha=1.0, seed=2)
    rb.extend(rows(0, 100))
    rb.update_priorities(np.arange(100), np.zeros(100))
    rb.update_priorities([42], [1000.0])
    share = (rb.sample(1000)["index"] == 42).float().mean().item()
    assert share > 0.9
    rb.update_priorities([42], [0.0])
    assert (rb.sample(1000)["index"] == 42).float().mean().item() < 0.05


def test_new_items_get_the_largest_priority_seen() -> None:
    rb = ReplayBuffer(TensorStorage(10), sampler="prioritized", alpha=1.0, seed=0)
    rb.extend(rows(0, 5))
    rb.update_priorities(np.arange(5), [0.0, 0.0, 7.0, 0.0, 0.0])
    rb.extend(rows(5, 1))
    assert rb._tree[[5]][0] == pytest.approx(7.0 + rb.eps)


def test_beta_anneals_linearly_to_one_over_beta_steps() -> None:
    rb = ReplayBuffer(TensorStorage(8), sampler="prioritized", alpha=1.0, beta=0.4, beta_steps=10, seed=0)
    rb.extend(rows(0, 2))
    rb.update_priorities([0, 1], [1.0, 3.0])
    ratio = (1.0 + rb.eps) / (3.0 + rb.eps)
    for k in range(14):
        beta = min(1.0, 0.4 + 0.6 * k / 10)
        assert rb.beta == pytest.approx(beta)
        batch = rb.sample(32)
        heavy = batch["weight"][batch["index"] == 1]
        assert torch.allclose(heavy, torch.tensor(ratio**beta, dtype=torch.float32))
    assert rb.stats()["beta"] == 1.0


# -- policy-age filter ----------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_policy_age_filter_never_returns_stale_items_and_counts_rejections(sampler: str) -> None:
    rb = ReplayBuffer(TensorStorage(200), sampler=sampler, max_policy_lag=3, seed=4)
    for version in range(10):
        rb.extend(rows(10 * version, 10, version=version))
    for _ in range(20):
        batch = rb.sample(64, policy_version=9)
        assert (batch["policy_version"] >= 6).all()
        assert_consistent(batch)
    stats = rb.stats()
    assert stats["rejected_stale"] > 0 and stats["sampled"] == 20 * 64
    assert rb.sample(64)["policy_version"].min() < 6  # no version given: no filter


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_policy_age_filter_finds_the_last_fresh_item_in_a_stale_buffer(sampler: str) -> None:
    rb = ReplayBuffer(TensorStorage(2000), sampler=sampler, max_policy_lag=0, seed=5, max_attempts=2)
    rb.extend(rows(0, 1999, version=0))
    rb.extend(rows(1999, 1, version=1))
    batch = rb.sample(16, policy_version=1)
    assert batch["id"].tolist() == [1999] * 16


def test_policy_age_filter_raises_a_clear_error_when_nothing_is_fresh() -> None:
    rb = ReplayBuffer(TensorStorage(20), max_policy_lag=1, seed=0)
    rb.extend(rows(0, 10, version=2))
    with pytest.raises(RuntimeError, match="newest stored is 2"):
        rb.sample(4, policy_version=10)
    with pytest.raises(RuntimeError, match="empty"):
        ReplayBuffer(TensorStorage(4)).sample(1)


# -- checkpoints and threads ----------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_buffer_reopened_from_a_checkpoint_samples_identically(tmp_path, sampler: str) -> None:
    rb = ReplayBuffer(TensorStorage(64, path=tmp_path / "rb"), sampler=sampler, beta_steps=20, seed=7)
    for i in range(5):
        rb.extend(rows(20 * i, 20))
        batch = rb.sample(16)
        rb.update_priorities(batch["index"], batch["id"].float())
    torch.save(rb.state_dict(), tmp_path / "rb.pt")
    expected = [rb.sample(16) for _ in range(3)]
    reopened = ReplayBuffer(TensorStorage(64, path=tmp_path / "rb"), sampler=sampler, beta_steps=20, seed=99)
    reopened.load_state_dict(torch.load(tmp_path / "rb.pt", weights_only=True))
    for want in expected:
        got = reopened.sample(16)
        assert (got == want).all()
    assert reopened.stats() == rb.stats()


def test_extend_from_a_writer_thread_while_sampling_is_safe() -> None:
    rb = ReplayBuffer(TensorStorage(300), sampler="prioritized", seed=0)
    rb.extend(rows(0, 16))
    sampled = sample_while_writing(rb, [rows(16 * i, 16) for i in range(1, 150)], 64, assert_consistent)
    assert len(rb) == 300 and rb.stats()["sampled"] == 64 * sampled
