"""The inference server: batch whatever observations are ready, one forward, fan out.

The serve loop is the same wherever it runs: :class:`InferenceServer` runs it
in a thread of the driver, :mod:`components.inference.process_server` in a
dedicated process. Environments never wait for a global barrier: the server
takes the requests that are ready, keeps draining for up to ``timeout``
seconds only while fewer than ``min_batch_size`` rows have arrived, and never
takes more than ``max_batch_size`` rows.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from components.inference.stats import ServerStats, now
from components.inference.transport import POLICY_VERSION, InferenceTransport, Pending
from components.serving import serving_engine


@dataclass(frozen=True)
class ServerConfig:
    """Batching and placement of one inference server.

    Attributes:
        max_batch_size: most observation rows in one forward pass.
        min_batch_size: rows to wait for (up to ``timeout``) before a pass.
        timeout: seconds to keep draining while below ``min_batch_size``.
        stats_window: batches the statistics window covers.
        device: where the policy runs ("cpu", "cuda", "cuda:1", ...).
        output_device: where responses are delivered (always host for shared slots).
        num_threads: torch intra-op threads of a server process (None: leave as is).
        seed: seed of the server's sampling RNG.
        engine: "auto", "torch" or "numpy" (see :mod:`components.serving`).
        static_batch_size: on CUDA, pad batches to this size and replay a
            captured CUDA graph (None: plain eager forwards).
    """

    max_batch_size: int = 256
    min_batch_size: int = 1
    timeout: float = 0.002
    stats_window: int = 256
    device: str = "cpu"
    output_device: str = "cpu"
    num_threads: int | None = None
    seed: int | None = None
    engine: str = "auto"
    static_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 1 <= self.min_batch_size <= self.max_batch_size:
            raise ValueError(
                f"min_batch_size must be in [1, max_batch_size={self.max_batch_size}], got {self.min_batch_size}"
            )
        if self.timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {self.timeout}")


def state_of(weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    return weights.state_dict() if isinstance(weights, torch.nn.Module) else weights


def _concat(parts: list[Any]) -> Any:
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)


class ServeLoop:
    """The batching loop shared by thread and process servers.

    ``weights_source`` (optional) is polled between batches: an object with
    ``version`` and ``copy_into(model)``, e.g. shared-memory weights written
    by a trainer in another process. ``on_version`` is told every version
    the served model moves to.
    """

    _IDLE_WAIT_S = 0.05

    def __init__(
        self,
        model: Any,
        transport: InferenceTransport,
        config: ServerConfig,
        stats: ServerStats,
        weights_source: Any = None,
        on_version: Any = None,
    ) -> None:
        self.model = model
        self.served = serving_engine(model, config.engine, config.device, config.output_device, config.seed,
                                     config.static_batch_size)
        self.transport = transport
        self.config = config
        self.stats = stats
        self.version = 0
        self.model_lock = threading.Lock()
        self._weights_source = weights_source
        self._on_version = on_version
        self._versions: Any = None

    def apply_weights(self, weights: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Copy ``weights`` into the served model between batches and bump the version."""
        with self.model_lock, torch.no_grad():
            own = self.model.state_dict()
            for key, value in weights.items():
                own[key].copy_(value, non_blocking=True)
            self.version = self.version + 1 if version is None else version
            self._published(self.version)
            return self.version

    def _published(self, version: int) -> None:
        refresh = getattr(self.served, "refresh", None)
        if refresh is not None:
            refresh()
        self.stats.record_weight_update(version)
        if self._on_version is not None:
            self._on_version(version)

    def poll_weights(self) -> None:
        source = self._weights_source
        if source is not None and source.version != self.version:
            with self.model_lock:
                self.version = source.copy_into(self.model)
                self._published(self.version)

    def serve(self, stop: threading.Event) -> None:
        cfg, transport = self.config, self.transport
        while not stop.is_set():
            self.poll_weights()
            if not transport.wait_for_work(self._IDLE_WAIT_S):
                continue
            requests = transport.drain(cfg.max_batch_size)
            if not requests:
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
        with self.model_lock:
            if n <= step:
                out, passes = self.served.act(inputs, modes), 1
            else:
                parts = [self.served.act({k: v[i : i + step] for k, v in inputs.items()}, modes[i : i + step])
                         for i in range(0, n, step)]
                out, passes = {k: _concat([p[k] for p in parts]) for k in parts[0]}, len(parts)
            if POLICY_VERSION not in out:  # a relay passes the upstream stamp through
                out[POLICY_VERSION] = self._version_column(out["action"], n)
        return out, passes

    def run_batch(self, requests: list[Pending], rows: int) -> None:
        start = now()
        try:
            out, passes = self._forward(requests)
        except Exception as exc:  # noqa: BLE001 - delivered to the requesters
            self._isolate_failure(requests, exc)
            return
        end = now()
        self.transport.resolve(requests, out)
        self.stats.record_batch(start, end, rows, [p.submitted_at for p in requests], passes)

    def _isolate_failure(self, requests: list[Pending], exc: Exception) -> None:
        """A batch failed: serve its requests one by one so only the culprits get the error."""
        if len(requests) == 1:
            self.transport.resolve_exception(requests, exc)
            return
        for pending in requests:
            try:
                out, _ = self._forward([pending])
            except Exception as single:  # noqa: BLE001
                self.transport.resolve_exception([pending], single)
            else:
                self.transport.resolve([pending], out)


class InferenceServer:
    """Serves a model to a transport's clients from a background thread.

    Examples:
        >>> from components.inference.thread_transport import ThreadTransport
        >>> from components.envs import EnvSpec
        >>> from components.models import ActorCritic
        >>> model = ActorCritic(EnvSpec((4,), "float32", "discrete", action_n=2))
        >>> transport = ThreadTransport()
        >>> with InferenceServer(model, transport) as server:
        ...     out = transport.client().submit({"observation": torch.zeros(3, 4)}).result(timeout=5)
        >>> out["action"].shape, int(out["policy_version"][0])
        (torch.Size([3]), 0)
    """

    backend = "thread"

    def __init__(
        self,
        model: Any,
        transport: InferenceTransport,
        config: ServerConfig | None = None,
        *,
        weights_source: Any = None,
    ) -> None:
        self.config = config or ServerConfig()
        self.transport = transport
        self._stats = ServerStats(self.config.stats_window)
        self._loop = ServeLoop(model, transport, self.config, self._stats, weights_source)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def model(self) -> Any:
        return self._loop.model

    def start(self) -> InferenceServer:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="inference-server", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._loop.serve(self._stop)
        except BaseException as exc:  # noqa: BLE001 - surfaced through is_alive/error
            self._error = exc
        finally:
            self.transport.close()
            release = getattr(self.transport, "release_liveness_handle", None)
            if release is not None:
                release()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def policy_version(self) -> int:
        return self._loop.version

    def update_weights(self, weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> int:
        """Swap in new parameters between two batches; returns the new version."""
        return self._loop.apply_weights(state_of(weights))

    def stats(self, reset: bool = False) -> dict[str, float]:
        return self._stats.summary(reset=reset)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop serving and fail every request still queued (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self.transport.close()

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
