"""The serve loop: batch whatever observations are ready, one forward, fan out.

The loop is the same wherever the server runs (a thread of the driver or its
own process, see :mod:`components.inference.server`): environments never
wait for a global barrier; the loop takes the requests that are ready, keeps
draining for up to ``timeout`` seconds only while fewer than
``min_batch_size`` rows have arrived, and never takes more than
``max_batch_size`` rows into one forward pass.

Every turn of the loop beats a progress clock (the time of the turn and a
counter) and the loop publishes what it is doing (:data:`SERVER_ACTIVITIES`);
each wait is bounded, so a live server beats every few tens of
milliseconds even when idle, and one that stops beating while requests
wait is frozen (see :mod:`components.collector.monitor`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from components.inference.serving import ENGINES, serving_engine
from components.inference.stats import ServerStats, now
from components.inference.transport import POLICY_VERSION, InferenceTransport, Pending
from components.obs_tree import ObsLeaf

#: What the serve loop is doing now, by code (the ``activity`` of a :class:`ServerPulse`).
SERVER_ACTIVITIES = ("starting", "waiting for requests", "running a forward pass", "applying new weights")
SERVER_STARTING, SERVER_WAITING, SERVER_FORWARD, SERVER_WEIGHTS = range(len(SERVER_ACTIVITIES))


class ServerPulse:
    """Where a serve loop beats: ``progress`` (monotonic time of its last turn), ``beats``, ``activity``.

    One-element arrays, shared memory in a server's control block (plain
    arrays by default), so the driver reads them without asking the server.
    """

    def __init__(self, progress: np.ndarray | None = None, beats: np.ndarray | None = None,
                 activity: np.ndarray | None = None) -> None:
        self.progress = progress if progress is not None else np.zeros(1, np.float64)
        self.beats = beats if beats is not None else np.zeros(1, np.int64)
        self.activity = activity if activity is not None else np.zeros(1, np.int8)


@dataclass(frozen=True)
class ServerConfig:
    """Batching and placement of one inference server.

    Attributes:
        max_batch_size: most observation rows in one forward pass.
        min_batch_size: rows to wait for (up to ``timeout``) before a pass.
        timeout: seconds to keep draining while below ``min_batch_size``.
        stats_reservoir: samples kept per interval for the latency and
            forward-time percentiles (counters are exact regardless).
        device: where the policy runs ("cpu", "cuda", "cuda:1", ...).
        num_threads: torch intra-op threads of a server process (None: leave
            as is; a server thread shares the driver's setting).
        seed: seed of the server's sampling RNG.
        engine: "torch" or "numpy" ("auto" is resolved by the runner's plan;
            here it means: numpy when the model allows, see
            :mod:`components.inference.serving`).
        static_batch_size: on CUDA, pad batches to this size and replay a
            captured CUDA graph (None: plain eager forwards).
        deterministic: one forward per request (a worker's block), never
            merged with others, so a row's outputs are computed in the same
            batch shape whatever else is ready (BLAS kernels may round a
            row differently in another shape); torch's deterministic
            algorithms in a server process.

    Examples:
        >>> ServerConfig(max_batch_size=64, min_batch_size=8).timeout
        0.002
        >>> ServerConfig(min_batch_size=0)
        Traceback (most recent call last):
        ...
        ValueError: min_batch_size must be in [1, max_batch_size=256], got 0
    """

    max_batch_size: int = 256
    min_batch_size: int = 1
    timeout: float = 0.002
    stats_reservoir: int = 2048
    device: str = "cpu"
    num_threads: int | None = None
    seed: int | None = None
    engine: str = "auto"
    static_batch_size: int | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 1 <= self.min_batch_size <= self.max_batch_size:
            raise ValueError(
                f"min_batch_size must be in [1, max_batch_size={self.max_batch_size}], got {self.min_batch_size}"
            )
        if self.timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {self.timeout}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")


def _concat(parts: list[Any]) -> Any:
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)


class ServeLoop:
    """The batching loop every server placement runs.

    ``weights_source`` (optional) is polled between batches: an object with
    ``seq`` and ``copy_into(model) -> (version, seq)``, e.g. the shared
    weights a trainer publishes into. ``on_version`` is told every version
    the served model moves to. ``version`` is the label stamped on every
    response; it starts at the initial policy version.
    """

    _IDLE_WAIT_S = 0.05

    def __init__(
        self,
        model: Any,
        transport: InferenceTransport,
        config: ServerConfig,
        stats: ServerStats,
        *,
        weights_source: Any = None,
        on_version: Any = None,
        version: int = 0,
        pulse: ServerPulse | None = None,
        obs_leaves: Sequence[ObsLeaf] = (),
    ) -> None:
        self.model = model
        self.pulse = pulse or ServerPulse()
        self.served = serving_engine(model, config.engine, config.device, "cpu", config.seed,
                                     config.static_batch_size, obs_leaves)
        self.transport = transport
        self.config = config
        self.stats = stats
        self.version = version
        self._seq = 0
        self._weights_source = weights_source
        self._on_version = on_version
        self._versions: Any = None

    def poll_weights(self) -> None:
        """Apply weights published since the last look (between batches only)."""
        source = self._weights_source
        if source is None or source.seq == self._seq:
            return
        self.pulse.activity[0] = SERVER_WEIGHTS
        self.version, self._seq = source.copy_into(self.model)
        refresh = getattr(self.served, "refresh", None)
        if refresh is not None:
            refresh()
        self.stats.record_weight_update(self.version)
        if self._on_version is not None:
            self._on_version(self.version)
        self.pulse.activity[0] = SERVER_WAITING

    def serve(self, stop: threading.Event) -> None:
        cfg, transport = self.config, self.transport
        progress, beats, activity = self.pulse.progress, self.pulse.beats, self.pulse.activity
        monotonic = time.monotonic
        activity[0] = SERVER_WAITING
        while not stop.is_set():
            progress[0] = monotonic()  # every turn, idle ones included: a live server always beats
            beats[0] += 1
            self.poll_weights()
            if not transport.wait_for_work(self._IDLE_WAIT_S):
                continue
            requests = transport.drain(cfg.max_batch_size)
            if not requests:
                continue
            # weights published while this loop waited: a request sent after a publish is served by it
            self.poll_weights()
            if cfg.deterministic:
                for pending in requests:
                    self.run_batch([pending], pending.rows)
                continue
            rows = sum(p.rows for p in requests)
            if rows < cfg.min_batch_size:
                requests, rows = self._top_up(requests, rows)
            self.run_batch(requests, rows)

    def _top_up(self, requests: list[Pending], rows: int) -> tuple[list[Pending], int]:
        cfg, transport = self.config, self.transport
        deadline = now() + cfg.timeout
        while rows < cfg.min_batch_size:
            left = deadline - now()
            if left <= 0 or not transport.wait_for_work(left):
                break
            more = transport.drain(cfg.max_batch_size - rows)
            if more and rows + sum(p.rows for p in more) > cfg.max_batch_size:
                # drain() always hands over one whole request; it would overflow.
                self.run_batch(requests, rows)
                return more, sum(p.rows for p in more)
            requests += more
            rows += sum(p.rows for p in more)
        return requests, rows

    def _version_column(self, like: Any, n: int) -> Any:
        """``n`` copies of the current version, as numpy or torch like ``like``."""
        column = self._versions
        if column is None or column.shape[0] < n or int(column[0]) != self.version or type(column) is not type(like):
            size = max(n, 256)
            if isinstance(like, np.ndarray):
                column = np.full(size, self.version, np.int64)
            else:
                column = torch.full((size,), self.version, dtype=torch.int64, device=like.device)
            self._versions = column
        return column[:n]

    def _forward(self, requests: list[Pending]) -> tuple[dict[str, Any], int]:
        """Outputs for ``requests`` and the number of forward passes they took.

        A block larger than ``max_batch_size`` rows is served in slices, so
        no pass ever exceeds the configured batch size.
        """
        inputs, modes = self.transport.gather(requests)
        step = self.config.max_batch_size
        n = modes.shape[0]
        if n <= step:
            out, passes = self.served.act(inputs, modes), 1
        else:
            parts = [self.served.act({k: v[i : i + step] for k, v in inputs.items()}, modes[i : i + step])
                     for i in range(0, n, step)]
            out, passes = {k: _concat([p[k] for p in parts]) for k in parts[0]}, len(parts)
        if POLICY_VERSION not in out:  # a model may stamp its own (tests do)
            out[POLICY_VERSION] = self._version_column(out["action"], n)
        return out, passes

    def run_batch(self, requests: list[Pending], rows: int) -> None:
        activity = self.pulse.activity
        activity[0] = SERVER_FORWARD
        start = now()
        try:
            out, passes = self._forward(requests)
        except Exception as exc:  # noqa: BLE001 - delivered to the requesters
            self._isolate_failure(requests, exc)
            activity[0] = SERVER_WAITING
            return
        # Recorded before the requesters wake: whoever reads the statistics after
        # an answer arrived finds that batch counted.
        self.stats.record_batch(start, now(), rows, [p.submitted_at for p in requests], passes)
        self.transport.resolve(requests, out)
        activity[0] = SERVER_WAITING

    def _isolate_failure(self, requests: list[Pending], exc: Exception) -> None:
        """A batch failed: serve its requests one by one so only the culprits get the error."""
        if len(requests) == 1:
            self.transport.resolve_exception(requests, exc)
            return
        for pending in requests:
            start = now()
            try:
                out, passes = self._forward([pending])
            except Exception as single:  # noqa: BLE001
                self.transport.resolve_exception([pending], single)
            else:
                self.stats.record_batch(start, now(), pending.rows, [pending.submitted_at], passes)
                self.transport.resolve([pending], out)
