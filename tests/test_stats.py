"""ServerStats: exact per-interval counters, sampled percentiles, thread safety."""

from __future__ import annotations

import math
import random
import threading

import pytest

from components.inference.stats import STAT_KEYS, ServerStats


class FakeClock:
    """A clock the test moves by hand, so rates never depend on machine load."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_reservoir_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ServerStats(reservoir=0)


def test_interval_counters_are_exact_far_beyond_reservoir_capacity() -> None:
    stats = ServerStats(reservoir=64)
    for i in range(10_000):
        stats.record_batch(start=float(i), end=i + 0.001, rows=4, submitted=[i - 0.01, i - 0.02])
    s = stats.read()
    assert (s["requests"], s["batches"], s["rows"]) == (20_000, 10_000, 40_000)
    assert s["avg_batch_size"] == 4.0
    assert s["avg_requests_per_batch"] == 2.0
    assert (s["requests_total"], s["batches_total"], s["rows_total"]) == (20_000, 10_000, 40_000)


def test_read_with_reset_starts_next_interval_from_zero_while_totals_keep_growing() -> None:
    stats = ServerStats(reservoir=8)
    for _ in range(300):
        stats.record_batch(0.0, 0.001, rows=3, submitted=[0.0])
    first = stats.read()
    empty = stats.read()
    assert (empty["requests"], empty["batches"], empty["rows"]) == (0, 0, 0)
    for _ in range(5):
        stats.record_batch(0.0, 0.001, rows=7, submitted=[0.0, 0.0])
    second = stats.read()
    assert (first["rows"], second["rows"]) == (900, 35)
    assert (second["requests"], second["batches"]) == (10, 5)
    assert (second["rows_total"], second["requests_total"], second["batches_total"]) == (935, 310, 305)


def test_read_without_reset_keeps_accumulating_the_same_interval() -> None:
    stats = ServerStats()
    stats.record_batch(0.0, 0.001, rows=2, submitted=[0.0])
    assert stats.read(reset=False)["rows"] == 2
    stats.record_batch(0.0, 0.001, rows=5, submitted=[0.0])
    assert stats.read(reset=False)["rows"] == 7
    assert stats.read(reset=True)["rows"] == 7
    assert stats.read()["rows"] == 0


def test_weight_updates_count_the_interval_and_total_and_version_is_the_last() -> None:
    stats = ServerStats(policy_version=3)
    assert stats.read()["policy_version"] == 3
    for v in (4, 5, 6):
        stats.record_weight_update(v)
    s = stats.read()
    assert (s["weight_updates"], s["weight_updates_total"], s["policy_version"]) == (3, 3, 6)
    stats.record_weight_update(9)
    s = stats.read()
    assert (s["weight_updates"], s["weight_updates_total"], s["policy_version"]) == (1, 4, 9)
    s = stats.read()
    assert (s["weight_updates"], s["weight_updates_total"], s["policy_version"]) == (0, 4, 9)


def test_percentiles_from_reservoir_approximate_true_ones_and_reservoir_stays_bounded() -> None:
    capacity = 512
    stats = ServerStats(reservoir=capacity, seed=1)
    rng = random.Random(42)
    for _ in range(5_000):
        # Queue latencies uniform in 0..100 ms (4 requests a batch); forward uniform 0..10 ms.
        start = 10.0
        stats.record_batch(start, start + rng.uniform(0.0, 0.010), rows=4, submitted=[start - rng.uniform(0.0, 0.1) for _ in range(4)])
        assert len(stats._latency.samples) <= capacity
        assert len(stats._forward.samples) <= capacity
    assert len(stats._latency.samples) == capacity
    assert len(stats._forward.samples) == capacity
    s = stats.read()
    assert s["queue_latency_p50_ms"] == pytest.approx(50.0, abs=6.0)
    assert s["queue_latency_p95_ms"] == pytest.approx(95.0, abs=3.0)
    assert s["forward_p50_ms"] == pytest.approx(5.0, abs=0.6)
    assert s["forward_p95_ms"] == pytest.approx(9.5, abs=0.3)


def test_reservoir_keeps_late_samples_not_just_the_first_ones() -> None:
    # A reservoir that only kept the first values would report ~1 ms here.
    stats = ServerStats(reservoir=32, seed=0)
    for _ in range(100):
        stats.record_batch(0.0, 0.001, rows=1, submitted=[0.0])
    for _ in range(10_000):
        stats.record_batch(0.0, 0.009, rows=1, submitted=[0.0])
    assert stats.read()["forward_p50_ms"] == pytest.approx(9.0)


def test_percentiles_cover_only_the_current_interval() -> None:
    stats = ServerStats(reservoir=16)
    for _ in range(50):
        stats.record_batch(1.0, 1.050, rows=1, submitted=[0.9])
    stats.read()
    stats.record_batch(1.0, 1.002, rows=1, submitted=[0.999])
    s = stats.read()
    assert s["forward_p95_ms"] == pytest.approx(2.0)
    assert s["queue_latency_p95_ms"] == pytest.approx(1.0)


def test_multiple_passes_count_as_batches_and_forward_time_is_per_pass() -> None:
    stats = ServerStats()
    stats.record_batch(start=0.0, end=0.030, rows=12, submitted=[0.0, 0.0], passes=3)
    s = stats.read()
    assert s["batches"] == 3
    assert s["batches_total"] == 3
    assert s["avg_batch_size"] == 4.0
    assert s["avg_requests_per_batch"] == 2.0  # per record_batch call, not per pass
    assert s["forward_p50_ms"] == pytest.approx(10.0)
    assert s["forward_p95_ms"] == pytest.approx(10.0)


def test_empty_interval_gives_nan_for_undefined_values_and_zero_counters() -> None:
    clock = FakeClock()
    stats = ServerStats(clock=clock)
    clock.t += 2.0
    s = stats.read()
    assert tuple(s) == STAT_KEYS
    for key in ("requests", "batches", "rows", "weight_updates", "requests_total", "batches_total", "rows_total", "weight_updates_total"):
        assert s[key] == 0, key
    for key in ("requests_per_s", "batches_per_s", "rows_per_s"):
        assert s[key] == 0.0, key
    for key in ("avg_batch_size", "avg_requests_per_batch", "queue_latency_p50_ms", "queue_latency_p95_ms", "forward_p50_ms", "forward_p95_ms"):
        assert math.isnan(s[key]), key
    assert s["interval_s"] == 2.0
    assert s["policy_version"] == 0


def test_every_stat_key_is_present_in_order_after_batches() -> None:
    stats = ServerStats()
    stats.record_batch(0.0, 0.001, rows=1, submitted=[0.0])
    stats.record_weight_update(1)
    s = stats.read()
    assert tuple(s) == STAT_KEYS
    assert len(set(STAT_KEYS)) == len(STAT_KEYS)
    assert not any(math.isnan(v) for v in s.values())


def test_rates_divide_by_the_interval_wall_time() -> None:
    clock = FakeClock(50.0)
    stats = ServerStats(clock=clock)
    clock.t = 51.0
    stats.read()  # new interval starts at t=51
    for _ in range(10):
        # The batches' own timestamps span only 1 ms; the rate must not use them.
        stats.record_batch(start=60.0, end=60.001, rows=8, submitted=[59.9, 59.9])
    clock.t = 55.0
    s = stats.read()
    assert s["interval_s"] == 4.0
    assert s["rows_per_s"] == pytest.approx(80 / 4.0)
    assert s["requests_per_s"] == pytest.approx(20 / 4.0)
    assert s["batches_per_s"] == pytest.approx(10 / 4.0)


def test_concurrent_record_and_reset_reads_lose_no_rows() -> None:
    stats = ServerStats(reservoir=32)
    n_batches = 20_000
    done = threading.Event()

    def write() -> None:
        try:
            for i in range(n_batches):
                stats.record_batch(0.0, 0.001, rows=1 + i % 5, submitted=[0.0] * (1 + i % 3))
        finally:
            done.set()

    writer = threading.Thread(target=write, name="stats-test-writer", daemon=True)
    reads: list[dict[str, float]] = []
    writer.start()
    while not done.is_set():
        reads.append(stats.read(reset=True))
    writer.join(timeout=60)
    assert not writer.is_alive()
    reads.append(stats.read(reset=True))
    expected_rows = sum(1 + i % 5 for i in range(n_batches))
    expected_requests = sum(1 + i % 3 for i in range(n_batches))
    assert sum(r["rows"] for r in reads) == expected_rows
    assert sum(r["requests"] for r in reads) == expected_requests
    assert sum(r["batches"] for r in reads) == n_batches
    assert reads[-1]["rows_total"] == expected_rows
