"""Statistics of an inference server, exact over each logging interval.

Recording is the per-batch hot path, so it only bumps plain counters and feeds
two bounded reservoirs; rates and percentiles are computed when someone reads.
Counters are exact however many batches an interval holds (a fixed window
would silently report only its last few batches); only the percentiles are
estimated, from uniform samples of the interval.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import numpy as np

#: Every key :meth:`ServerStats.read` returns, always all of them, in this order.
STAT_KEYS = (
    "requests",
    "batches",
    "rows",
    "weight_updates",
    "requests_per_s",
    "batches_per_s",
    "rows_per_s",
    "interval_s",
    "avg_batch_size",
    "avg_requests_per_batch",
    "queue_latency_p50_ms",
    "queue_latency_p95_ms",
    "forward_p50_ms",
    "forward_p95_ms",
    "policy_version",
    "requests_total",
    "batches_total",
    "rows_total",
    "weight_updates_total",
)

_NAN = float("nan")


class _Reservoir:
    """A uniform sample of at most ``capacity`` values (Vitter's algorithm R).

    Memory and per-value cost stay constant however long an interval runs,
    while every value seen keeps the same chance of being in the sample.
    """

    __slots__ = ("capacity", "samples", "seen", "_rng")

    def __init__(self, capacity: int, rng: random.Random) -> None:
        self.capacity = capacity
        self.samples: list[float] = []
        self.seen = 0
        self._rng = rng

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.samples) < self.capacity:
            self.samples.append(value)
        else:
            j = self._rng.randrange(self.seen)
            if j < self.capacity:
                self.samples[j] = value

    def clear(self) -> None:
        self.samples = []
        self.seen = 0


class ServerStats:
    """Exact per-interval counters plus sampled percentiles, safe across threads.

    An interval runs from construction, or from the previous ``read(reset=True)``,
    to the next read, so a logger reading every few seconds sees exactly what was
    served in between. ``avg_batch_size`` counts observation rows (one env step
    each), which is what the forward pass sees; one request carries a whole block
    of rows. Undefined values of an empty interval are NaN, not a misleading 0.

    Examples:
        >>> stats = ServerStats(reservoir=16, clock=lambda: 0.0)
        >>> stats.record_batch(start=0.0, end=0.002, rows=8, submitted=[-0.001, -0.003])
        >>> s = stats.read()
        >>> s["avg_batch_size"], s["requests"], round(s["queue_latency_p95_ms"], 2)
        (8.0, 2, 2.9)
        >>> stats.read()["rows"], stats.read()["rows_total"]
        (0, 8)
    """

    def __init__(
        self,
        reservoir: int = 2048,
        seed: int = 0,
        policy_version: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if reservoir < 1:
            raise ValueError(f"stats reservoir must be >= 1, got {reservoir}")
        self._lock = threading.Lock()
        self._clock = clock
        rng = random.Random(seed)
        self._latency = _Reservoir(reservoir, rng)
        self._forward = _Reservoir(reservoir, rng)
        self._policy_version = policy_version
        self._requests_total = self._batches_total = self._rows_total = self._updates_total = 0
        self._start_interval()

    def _start_interval(self) -> None:
        """Zero the interval's counters and samples; the caller holds the lock (or is ``__init__``)."""
        self._interval_start = self._clock()
        self._requests = self._batches = self._rows = self._updates = self._calls = 0
        self._latency.clear()
        self._forward.clear()

    def record_batch(self, start: float, end: float, rows: int, submitted: list[float], passes: int = 1) -> None:
        """``passes`` forward passes from ``start`` to ``end`` over ``rows`` rows of ``len(submitted)`` requests.

        ``submitted`` holds each request's submit time, so its queue latency is
        ``start - t``.
        """
        with self._lock:
            n = len(submitted)
            self._requests += n
            self._batches += passes
            self._rows += rows
            self._calls += 1
            self._requests_total += n
            self._batches_total += passes
            self._rows_total += rows
            latency = self._latency
            if len(latency.samples) + n <= latency.capacity:  # not full yet: keep everything
                latency.samples.extend([start - t for t in submitted])
                latency.seen += n
            else:
                for t in submitted:
                    latency.add(start - t)
            self._forward.add((end - start) / passes)

    def record_weight_update(self, version: int) -> None:
        """The served policy moved to ``version``."""
        with self._lock:
            self._policy_version = version
            self._updates += 1
            self._updates_total += 1

    def read(self, reset: bool = True) -> dict[str, float]:
        """The current interval's statistics (every key of ``STAT_KEYS``); ``reset`` then starts a new interval."""
        with self._lock:
            elapsed = self._clock() - self._interval_start
            requests, batches, rows, calls = self._requests, self._batches, self._rows, self._calls
            out: dict[str, float] = {
                "requests": requests,
                "batches": batches,
                "rows": rows,
                "weight_updates": self._updates,
                "policy_version": self._policy_version,
                "requests_total": self._requests_total,
                "batches_total": self._batches_total,
                "rows_total": self._rows_total,
                "weight_updates_total": self._updates_total,
            }
            if reset:
                latencies, forwards = self._latency.samples, self._forward.samples
                self._start_interval()  # swaps in fresh sample lists, so ours stay untouched
            else:
                latencies, forwards = list(self._latency.samples), list(self._forward.samples)
        # Percentiles outside the lock: the recording thread must not wait on numpy.
        lat_p = _percentiles_ms(latencies)
        fwd_p = _percentiles_ms(forwards)
        rate = 1.0 / elapsed if elapsed > 0 else 0.0
        out.update(
            requests_per_s=requests * rate,
            batches_per_s=batches * rate,
            rows_per_s=rows * rate,
            interval_s=elapsed,
            avg_batch_size=rows / batches if batches else _NAN,
            avg_requests_per_batch=requests / calls if calls else _NAN,
            queue_latency_p50_ms=lat_p[0],
            queue_latency_p95_ms=lat_p[1],
            forward_p50_ms=fwd_p[0],
            forward_p95_ms=fwd_p[1],
        )
        return {key: out[key] for key in STAT_KEYS}


def _percentiles_ms(seconds: list[float]) -> tuple[float, float]:
    """p50 and p95 in milliseconds, NaN when there is no sample."""
    if not seconds:
        return _NAN, _NAN
    p50, p95 = np.percentile(np.asarray(seconds, dtype=np.float64), [50, 95]) * 1e3
    return float(p50), float(p95)


def now() -> float:
    """The clock every component stamps with: monotonic and shared by processes on one host."""
    return time.monotonic()
