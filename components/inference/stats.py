"""Sliding-window statistics of an inference server.

Recording is the per-batch hot path (a few appends to ring buffers);
summarising (percentiles, rates) only happens when someone asks.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

#: Every key :meth:`ServerStats.summary` returns, in a stable order.
STAT_KEYS = (
    "requests",
    "batches",
    "rows",
    "requests_per_s",
    "batches_per_s",
    "rows_per_s",
    "avg_batch_size",
    "avg_requests_per_batch",
    "queue_latency_p50_ms",
    "queue_latency_p95_ms",
    "forward_p50_ms",
    "forward_p95_ms",
    "policy_version",
    "weight_updates",
)


class ServerStats:
    """Counters over the last ``window`` batches, safe to read from another thread.

    ``avg_batch_size`` counts observation rows (one env step each), which is
    what the forward pass sees; one request carries a whole block of rows.

    Examples:
        >>> stats = ServerStats(window=10)
        >>> stats.record_batch(start=0.0, end=0.002, rows=8, submitted=[-0.001, -0.003])
        >>> s = stats.summary()
        >>> s["avg_batch_size"], s["requests"], round(s["queue_latency_p95_ms"], 2)
        (8.0, 2, 2.9)
    """

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"stats window must be >= 1, got {window}")
        self._lock = threading.Lock()
        self._window = window
        self._batches: deque[tuple[float, float, int, int, int]] = deque(maxlen=window)
        self._latencies: deque[float] = deque(maxlen=window * 8)
        self.policy_version = 0
        self.weight_updates = 0

    def record_batch(self, start: float, end: float, rows: int, submitted: list[float], passes: int = 1) -> None:
        """``passes`` forward passes from ``start`` to ``end`` over ``rows`` rows of ``len(submitted)`` requests."""
        with self._lock:
            self._batches.append((start, end, rows, len(submitted), passes))
            self._latencies.extend(start - t for t in submitted)

    def record_weight_update(self, version: int) -> None:
        with self._lock:
            self.policy_version = version
            self.weight_updates += 1

    def summary(self, reset: bool = False) -> dict[str, float]:
        """The window's statistics; ``reset`` empties the window afterwards."""
        with self._lock:
            batches = list(self._batches)
            latencies = np.asarray(self._latencies, dtype=np.float64)
            if reset:
                self._batches.clear()
                self._latencies.clear()
            version, updates = self.policy_version, self.weight_updates
        out = dict.fromkeys(STAT_KEYS, 0.0)
        out["policy_version"], out["weight_updates"] = version, updates
        if not batches:
            out.update(requests=0, batches=0, rows=0)
            return out
        arr = np.asarray(batches, dtype=np.float64)
        starts, ends, rows, requests, passes = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4]
        n_batches, n_rows, n_requests = int(passes.sum()), int(rows.sum()), int(requests.sum())
        # Rates over the span the window covers; a single batch spans its own forward.
        span = max(float(ends[-1] - starts[0]), 1e-9)
        forward_ms = (ends - starts) / passes * 1e3
        out.update(
            requests=n_requests,
            batches=n_batches,
            rows=n_rows,
            requests_per_s=n_requests / span,
            batches_per_s=n_batches / span,
            rows_per_s=n_rows / span,
            avg_batch_size=n_rows / n_batches,
            avg_requests_per_batch=n_requests / len(batches),
            forward_p50_ms=float(np.percentile(forward_ms, 50)),
            forward_p95_ms=float(np.percentile(forward_ms, 95)),
        )
        if latencies.size:
            out["queue_latency_p50_ms"] = float(np.percentile(latencies, 50) * 1e3)
            out["queue_latency_p95_ms"] = float(np.percentile(latencies, 95) * 1e3)
        return out


def now() -> float:
    """The clock every component stamps with: monotonic and shared by processes on one host."""
    return time.monotonic()
