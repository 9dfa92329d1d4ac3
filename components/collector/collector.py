"""AsyncBatchedCollector: env workers, an inference server, dense batches.

Environments never wait for a global barrier: each worker steps its block
as soon as its actions arrive, the server batches whatever is ready, and the
driver assembles exactly ``frames_per_batch`` transitions from whole chunks
(splitting one only at a batch boundary and carrying the rest, in order,
into the next batch).

Where each part runs is a :class:`GraphSpec`, already resolved (the runner's
plan decides ``auto``):

=========  =========  ======  ==============================================
workers    transport  server  wiring
=========  =========  ======  ==============================================
thread     driver     thread  queue transport, futures
thread     driver     process worker threads own slots of a process server
process    slots      process workers reach the inference process directly
process    slots      thread  workers reach a server thread of the driver
process    driver     any     workers' slots served by a driver relay thread
=========  =========  ======  ==============================================
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from components.collector.chunks import ChunkPool
from components.collector.pools import ProcessWorkers, ThreadWorkers, WorkerAssignment
from components.collector.worker import EXITED, FAILED, RUNNING, TIMING, WorkerControl, transition_fields
from components.envs import EnvSpec, env_seeds, probe_env_spec
from components.inference.client import FutureChannel, PolicyClient
from components.inference.process_server import ProcessInferenceServer
from components.inference.relay import UpstreamPolicy
from components.inference.server import InferenceServer, ServeLoop, ServerConfig
from components.inference.slots import SlotTransport
from components.inference.stats import ServerStats
from components.inference.thread_transport import ThreadTransport
from components.inference.transport import derive_layout
from components.interaction import InteractionMode
from components.models import ModelSpec

_POLL_S = 0.25


class CollectorError(RuntimeError):
    """A worker or the server failed; the message names which and why."""


@dataclass(frozen=True)
class GraphSpec:
    """Where each part of the collector graph runs (``auto`` already resolved).

    Attributes:
        workers: "thread" or "process" (the env backend).
        transport: "driver" (requests pass through the driver process) or
            "slots" (worker processes reach the server's shared slots directly).
        server: "thread" (in the driver) or "process" (a dedicated process).
        num_envs / envs_per_worker: env count and block size per worker.
        chunk_len: consecutive steps per worker message.
        splits: blocks each worker steps alternately, each with its own
            request (2 = double-buffered sampling: one block steps while the
            server computes the other's actions).
        chunks_per_worker: chunk buffers per worker (None: one batch ahead).
        worker_affinity: CPU sets for process workers, used round-robin.
        worker_nice: niceness increment of process workers (they yield to
            the inference server and the trainer).
    """

    workers: str = "thread"
    transport: str = "driver"
    server: str = "thread"
    num_envs: int = 8
    envs_per_worker: int = 4
    chunk_len: int = 1
    splits: int = 1
    chunks_per_worker: int | None = None
    worker_affinity: tuple[tuple[int, ...], ...] | None = None
    worker_nice: int = 0

    def __post_init__(self) -> None:
        if self.workers not in ("thread", "process"):
            raise ValueError(f"workers must be thread or process, got {self.workers!r}")
        if self.transport not in ("driver", "slots"):
            raise ValueError(f"transport must be driver or slots, got {self.transport!r}")
        if self.server not in ("thread", "process"):
            raise ValueError(f"server must be thread or process, got {self.server!r}")
        if self.transport == "slots" and self.workers != "process":
            raise ValueError("transport=slots needs process workers (thread workers already share the driver)")
        if min(self.num_envs, self.envs_per_worker, self.chunk_len, self.splits) < 1:
            raise ValueError("num_envs, envs_per_worker, chunk_len and splits must be >= 1")

    @property
    def num_workers(self) -> int:
        return math.ceil(self.num_envs / self.envs_per_worker)

    def worker_rows(self) -> list[int]:
        full, rest = divmod(self.num_envs, self.envs_per_worker)
        return [self.envs_per_worker] * full + ([rest] if rest else [])

    def split_sizes(self, rows: int) -> tuple[int, ...]:
        """How a worker of ``rows`` envs divides them into blocks (near-equal, in order)."""
        parts = min(self.splits, rows)
        base, extra = divmod(rows, parts)
        return tuple(base + (1 if i < extra else 0) for i in range(parts))


def _nest(flat: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


class AsyncBatchedCollector:
    """Iterates dense TensorDict batches of exactly ``frames_per_batch`` transitions.

    Every transition carries ``env_index`` and ``env_step`` (contiguous per
    env), the behaviour policy's outputs and ``policy_version``. Iteration
    stops at exactly ``total_frames`` (``-1``: never); a last batch is
    shorter when it does not divide.

    With a ``replay_buffer`` the collector is not iterated: :meth:`start`
    runs a writer thread that turns every batch into ``postproc(batch)``
    (e.g. n-step returns), extends the buffer with it, then calls
    ``on_batch(batch)`` with the raw batch (episode accounting and the
    trainer's backpressure: it may block). ``storing_device`` is where
    batches are placed before that.

    Example::

        collector = AsyncBatchedCollector(
            GymEnvFactory("CartPole-v1"), ModelSpec("components.models.ActorCritic"),
            GraphSpec(workers="process", transport="slots", server="process", num_envs=64,
                      envs_per_worker=32, chunk_len=64),
            frames_per_batch=4096, total_frames=1_000_000)
        for batch in collector:          # dense TensorDicts of 4096 transitions
            trainer.update(batch)
            collector.update_policy_weights_(trainer.model)
        collector.shutdown()
    """

    def __init__(
        self,
        env_factory: Callable[[], Any],
        model_spec: ModelSpec,
        graph: GraphSpec,
        *,
        frames_per_batch: int,
        total_frames: int = -1,
        seed: int = 0,
        server_config: ServerConfig | None = None,
        interaction_mode: Any = InteractionMode.RANDOM,
        env_spec: EnvSpec | None = None,
        replay_buffer: Any = None,
        postproc: Callable[[Any], Any] | None = None,
        on_batch: Callable[[Any], None] | None = None,
        storing_device: str = "cpu",
    ) -> None:
        if frames_per_batch < 1:
            raise ValueError(f"frames_per_batch must be >= 1, got {frames_per_batch}")
        if total_frames < -1 or total_frames == 0:
            raise ValueError(f"total_frames must be positive or -1 (endless), got {total_frames}")
        self.graph = graph
        self.frames_per_batch = frames_per_batch
        self.total_frames = total_frames
        self.env_factory = env_factory
        self.model_spec = model_spec
        self.interaction_mode = InteractionMode.parse(interaction_mode)
        self.server_config = server_config or ServerConfig()
        self.env_spec = env_spec or probe_env_spec(env_factory)
        self._seed = seed
        self.start_timeout = 120.0
        self._frames = 0
        self._started = False
        self._closed = False
        self._carry: tuple[int, int] | None = None
        self._iter_lock = threading.Lock()
        self._timing_mark: tuple[float, np.ndarray] | None = None
        self._pending_weights: Any = None
        self.replay_buffer = replay_buffer
        self.storing_device = torch.device(storing_device)
        self._postproc = postproc
        self._on_batch = on_batch
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._writer_error: BaseException | None = None
        self._mp = mp.get_context("spawn")
        self._build()

    # ------------------------------------------------------------------ build
    def _build(self) -> None:
        g, cfg = self.graph, self.server_config
        served = self.model_spec.build(self.env_spec).eval()
        self.layout = derive_layout(served, self.env_spec.observation_field())
        rows = g.worker_rows()
        self._rows = rows
        chunk_ctx = self._mp if g.workers == "process" else threading
        per_worker = g.chunks_per_worker or max(2, math.ceil(self.frames_per_batch / (g.chunk_len * g.num_envs)) + 1)
        self._pool = ChunkPool(
            transition_fields(self.env_spec.observation_field(), self.layout.response),
            rows=rows, chunk_len=g.chunk_len, chunks_per_worker=per_worker, ctx=chunk_ctx,
        )
        self._control = WorkerControl(len(rows))
        self._relay: ServeLoop | None = None
        self._relay_stop = threading.Event()
        self._relay_thread: threading.Thread | None = None

        # One request channel per block; a worker owns ``splits`` of them.
        splits = [g.split_sizes(r) for r in rows]
        self._splits = splits
        slot_rows = max(max(sizes) for sizes in splits)
        num_slots = sum(len(sizes) for sizes in splits)

        # The transport the server serves.
        if g.server == "thread" and not (g.workers == "process" and g.transport == "slots"):
            server_transport: Any = ThreadTransport(self.layout)
        elif g.workers == "process" and g.transport == "driver":
            # The relay forwards all ready blocks as one request.
            server_transport = SlotTransport(self.layout, num_slots=1, rows_per_slot=num_slots * slot_rows, ctx=self._mp)
        else:
            server_transport = SlotTransport(self.layout, num_slots=num_slots, rows_per_slot=slot_rows, ctx=self._mp)
        self._server_transport = server_transport
        if g.server == "thread":
            self.server: Any = InferenceServer(served, server_transport, cfg)
        else:
            self.server = ProcessInferenceServer(
                self.model_spec, self.env_spec, server_transport, cfg, template=served.state_dict(), ctx=self._mp
            )

        # What each worker holds to get actions.
        if g.workers == "process" and g.transport == "driver":
            relay_transport = SlotTransport(self.layout, num_slots=num_slots, rows_per_slot=slot_rows, ctx=self._mp)
            relay_cfg = ServerConfig(max_batch_size=num_slots * slot_rows, min_batch_size=1, timeout=0.0)
            self._relay = ServeLoop(UpstreamPolicy(server_transport.client()), relay_transport, relay_cfg, ServerStats(1))

            def channel(size: int) -> Any:
                return relay_transport.client()
        elif isinstance(server_transport, ThreadTransport):
            def channel(size: int) -> Any:
                policy = PolicyClient(server_transport.client(), interaction_mode=self.interaction_mode)
                return FutureChannel(policy, self.layout.request, size)
        else:
            def channel(size: int) -> Any:
                return server_transport.client()
        self._channels = [[channel(size) for size in sizes] for sizes in splits]
        self.workers: Any = ProcessWorkers(self._mp, g.worker_nice) if g.workers == "process" else ThreadWorkers()

    # -------------------------------------------------------------- lifecycle
    def start(self) -> AsyncBatchedCollector:
        """Start the server, the relay (if any) and the workers; idempotent.

        With a ``replay_buffer`` it also starts the writer thread, which
        extends the buffer with every batch (one ``extend`` per batch) until
        ``total_frames``, so collection goes on while a trainer samples.
        """
        if self._started:
            return self
        if self._closed:
            raise RuntimeError("this collector was shut down; build a new one")
        self._started = True
        try:
            self.server.start()
            if self._pending_weights is not None:
                self.server.update_weights(self._pending_weights)
                self._pending_weights = None
            if self._relay is not None:
                self._relay_thread = threading.Thread(
                    target=self._relay.serve, args=(self._relay_stop,), name="driver-relay", daemon=True
                )
                self._relay_thread.start()
            seeds = env_seeds(self._seed, self.graph.num_envs)
            assignments, first = [], 0
            for w, r in enumerate(self._rows):
                ids = tuple(range(first, first + r))
                assignments.append(WorkerAssignment(w, ids, tuple(seeds[i] for i in ids), self._splits[w]))
                first += r
            affinity = [list(a) for a in self.graph.worker_affinity] if self.graph.worker_affinity else None
            self.workers.start(
                assignments, self.env_factory, self._channels,
                [self._pool.writer(w) for w in range(len(self._rows))],
                self._control, int(self.interaction_mode), self.layout.response_keys, affinity,
            )
            self._wait_running(self.start_timeout)
            self._timing_mark = (time.monotonic(), self._control.timing.copy())
            if self.replay_buffer is not None:
                self._writer = threading.Thread(target=self._write_loop, name="replay-writer", daemon=True)
                self._writer.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _wait_running(self, timeout: float) -> None:
        """Block until every worker has built its envs, so start-up errors surface here."""
        deadline = time.monotonic() + timeout
        status = self._control.status
        while not all(status[w] in (RUNNING, EXITED) for w in range(len(self._rows))):
            self._check_health()
            if time.monotonic() > deadline:
                raise CollectorError(f"env workers did not start within {timeout:.0f} s")
            time.sleep(0.005)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop workers, relay and server, and join them all (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._control.stop[0] = 1
        self._control.pause[0] = 0
        if self._started:
            self.workers.join(timeout)
        if self._writer is not None:
            self._writer.join(timeout)
        self._relay_stop.set()
        if self._relay_thread is not None:
            self._relay_thread.join(timeout)
        self.server.shutdown(timeout)

    def __enter__(self) -> AsyncBatchedCollector:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown(timeout=1.0)

    # ----------------------------------------------------------------- writer
    def _write_loop(self) -> None:
        try:
            while self.total_frames < 0 or self._frames < self.total_frames:
                left = self.frames_per_batch if self.total_frames < 0 else self.total_frames - self._frames
                batch = self.next_batch(min(self.frames_per_batch, left))
                with self._writer_lock:  # pause() holds it: no write while paused
                    stored = batch if self._postproc is None else self._postproc(batch)
                    if stored.numel():
                        self.replay_buffer.extend(stored)
                if self._on_batch is not None:
                    self._on_batch(batch)  # the batch is in replay now; may wait: the trainer's backpressure
        except BaseException as exc:  # noqa: BLE001 - surfaced by check_writer()
            if not self._closed:
                self._writer_error = exc

    @property
    def writing(self) -> bool:
        """Whether the replay writer is still collecting."""
        return self._writer is not None and self._writer.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed

    def check_writer(self) -> None:
        """Raise the replay writer's error, if it stopped with one."""
        if self._writer_error is not None:
            error = self._writer_error
            if isinstance(error, CollectorError):
                raise CollectorError(str(error)) from error
            raise CollectorError(f"the replay writer failed: {error!r}") from error

    # ----------------------------------------------------------------- health
    def _check_health(self) -> None:
        status = self._control.status
        for w in range(len(self._rows)):
            if status[w] == FAILED:
                raise CollectorError(self._control.error(w))
            if not self.workers.alive(w) and status[w] != EXITED:
                raise CollectorError(f"env worker {w} stopped unexpectedly: {self.workers.exit_description(w)}")
        if not self.server.is_alive:
            detail = self.server.error or "it exited"
            raise CollectorError(f"the inference server ({self.server.backend}) died: {detail}")
        if self._relay_thread is not None and not self._relay_thread.is_alive():
            raise CollectorError("the driver relay thread stopped")

    def _next_chunk(self) -> int:
        while True:
            if self._closed:
                raise CollectorError("the collector was shut down")
            gid = self._pool.next_ready(_POLL_S)
            if gid is not None:
                return gid
            self._check_health()

    # ------------------------------------------------------------- iteration
    @property
    def frames(self) -> int:
        """Frames delivered so far."""
        return self._frames

    def next_batch(self, frames: int | None = None) -> Any:
        """Assemble the next batch of ``frames`` transitions (default ``frames_per_batch``).

        Whole chunks are gathered with one copy per field; a chunk is split
        only where the batch ends, and its rest opens the next batch.
        """
        from tensordict import TensorDict

        n = frames or self.frames_per_batch
        pool = self._pool
        segments: list[tuple[int, int, int]] = []  # (chunk, first frame, frames taken)
        filled = 0
        while filled < n:
            if self._carry is not None:
                (gid, start), self._carry = self._carry, None
            else:
                gid, start = self._next_chunk(), 0
            available = pool.frames_in(gid) - start
            take = min(available, n - filled)
            segments.append((gid, start, take))
            filled += take
            if take < available:
                self._carry = (gid, start + take)
        out = {f.name: torch.empty((n, *f.shape), dtype=getattr(torch, f.dtype)) for f in pool.fields}
        pos, i = 0, 0
        while i < len(segments):
            j = i
            while j < len(segments) and segments[j][1] == 0 and segments[j][2] == pool.frames_in(segments[j][0]) \
                    and pool.full_width(segments[j][0]):
                j += 1
            if j - i >= 2:
                pos += pool.gather_into([s[0] for s in segments[i:j]], out, pos)
                i = j
                continue
            gid, start, take = segments[i]
            for key, view in pool.flat(gid).items():
                out[key][pos : pos + take] = view[start : start + take]
            pos += take
            i += 1
        for gid, start, take in segments:
            if self._carry is None or self._carry[0] != gid:
                pool.release(gid)
        self._frames += n
        batch = TensorDict(_nest(out), batch_size=[n])
        return batch if self.storing_device.type == "cpu" else batch.to(self.storing_device, non_blocking=True)

    def __iter__(self) -> Iterator[Any]:
        if self.replay_buffer is not None:
            raise RuntimeError("this collector writes to its replay buffer; sample the buffer instead of iterating")
        if not self._iter_lock.acquire(blocking=False):
            raise RuntimeError("the collector is already being iterated")
        try:
            self.start()
            while self.total_frames < 0 or self._frames < self.total_frames:
                left = self.frames_per_batch if self.total_frames < 0 else self.total_frames - self._frames
                yield self.next_batch(min(self.frames_per_batch, left))
        finally:
            self._iter_lock.release()

    # ---------------------------------------------------------------- control
    def update_policy_weights_(self, weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> None:
        """Push trainer weights to the server (applied between batches, version bumped).

        Weights pushed before :meth:`start` are applied before any request is served.
        """
        if not self._started:
            state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
            self._pending_weights = {k: v.detach().clone() for k, v in state.items()}
            return
        self.server.update_weights(weights)

    @property
    def policy_version(self) -> int:
        return self.server.policy_version

    def server_stats(self, reset: bool = False) -> dict[str, float]:
        return self.server.stats(reset=reset)

    def worker_stats(self) -> dict[str, float]:
        """Where worker time went since the last call, as fractions of wall time.

        ``env`` (stepping envs), ``infer_wait`` (waiting for actions) and
        ``chunk_wait`` (waiting for a free chunk: the trainer is the
        bottleneck); per worker and averaged, plus frames/s.
        """
        now = time.monotonic()
        timing = self._control.timing.copy()
        if self._timing_mark is None:
            self._timing_mark = (now, timing)
            return {}
        since, before = self._timing_mark
        self._timing_mark = (now, timing)
        wall = max(now - since, 1e-9)
        delta = timing - before
        out: dict[str, float] = {}
        names = ("env", "infer_wait", "chunk_wait")
        for w in range(delta.shape[0]):
            for c, name in enumerate(names):
                out[f"worker{w}/{name}_frac"] = float(delta[w, c] / wall)
        for c, name in enumerate(names):
            out[f"{name}_frac"] = float(delta[:, c].mean() / wall)
        out["worker_frames_per_s"] = float(delta[:, TIMING.index("frames")].sum() / wall)
        fracs = {name: out[f"{name}_frac"] for name in names}
        out["bound"] = max(fracs, key=fracs.get)  # type: ignore[arg-type]
        return out

    @contextlib.contextmanager
    def pause(self, timeout: float = 30.0) -> Iterator[None]:
        """Quiesce env workers, the server and the replay writer for the block.

        Workers park at a step boundary, after their last request was
        answered; transitions already in chunks stay there, in order; the
        writer finishes the extend it is in and waits. Everything resumes
        where it stopped: no transition is lost or written twice.
        """
        if not self._started or self._closed:
            yield
            return
        control = self._control
        control.pause[0] = 1
        locked = False
        try:
            if not self._writer_lock.acquire(timeout=timeout):
                raise TimeoutError(f"the replay writer did not pause within {timeout} s")
            locked = True
            deadline = time.monotonic() + timeout
            while True:
                parked = [bool(control.paused[w]) or control.status[w] in (EXITED, FAILED)
                          for w in range(len(self._rows))]
                if all(parked):
                    break
                self._check_health()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"env workers did not pause within {timeout} s")
                time.sleep(0.002)
            yield
        finally:
            if locked:
                self._writer_lock.release()
            control.pause[0] = 0
