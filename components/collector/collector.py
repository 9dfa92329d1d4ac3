"""AsyncBatchedCollector: env workers, an inference server, dense batches.

Environments never wait for a global barrier (unless ``lockstep``): each worker steps its block as soon as
its actions arrive, the server batches whatever is ready, and the driver assembles exactly
``frames_per_batch`` transitions from whole chunks. There is one wiring, with the placements (a resolved
:class:`GraphSpec`) as parameters: every block owns a request slot of one
:class:`~components.inference.slots.SlotTransport` (``threading`` primitives when everything is in the
driver, a ``spawn`` context when a worker or the server is a process), served by one
:class:`~components.inference.server.InferenceServer` in a driver thread or its own process.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from components.collector.assembly import BatchAssembler, nest
from components.collector.chunks import ChunkPool
from components.collector.failures import CollectorError
from components.collector.graph import GraphSpec
from components.collector.lockstep import Lockstep, lockstep_problem
from components.collector.monitor import GraphMonitor
from components.collector.pools import ProcessWorkers, ThreadWorkers, WorkerAssignment
from components.collector.repair import GraphRepair
from components.collector.restarts import WorkerRestarts
from components.collector.worker import transition_fields
from components.collector.worker_control import RUNNING, WorkerControl
from components.collector.stream import BatchStream
from components.successors import CUT_SUCCESSORS_KEY, reads_every_row
from components.envs import EnvSpec, env_seeds, probe_env_spec
from components.inference.inline import InlineServer
from components.inference.loop import ServerConfig
from components.inference.server import InferenceServer, ServerError
from components.inference.slots import SlotTransport
from components.inference.transport import derive_layout
from components.inference.weights import WeightsLockError
from components.interaction import InteractionMode
from components.lifecycle import release_semaphore_names, shutdown_at_exit
from components.models import ModelSpec

__all__ = ["AsyncBatchedCollector", "CollectorError", "GraphSpec"]
_POLL_S = 0.25


class AsyncBatchedCollector(GraphRepair, BatchStream):
    """Iterates dense TensorDict batches of exactly ``frames_per_batch`` transitions.

    Every transition carries ``env_index`` and ``env_step`` (contiguous per
    env), the behaviour policy's outputs and ``policy_version`` (the label
    of the weights that acted: ``policy_version`` for the initial ones, then
    whatever :meth:`update_policy_weights_` was given). Iteration stops at
    exactly ``total_frames`` (``-1``: never); a last batch is shorter when
    it does not divide.

    With a ``replay_buffer`` the collector is not iterated: :meth:`start`
    runs a writer thread that turns every batch into ``postproc(batch)``
    (e.g. n-step returns), extends the buffer with it, then calls
    ``on_batch(batch)`` with the raw batch (episode accounting and the
    trainer's backpressure: it may block).

    Other options, as in TorchRL's collector of the same name:
    ``yield_completed_trajectories`` yields whole finished trajectories, at
    least ``frames_per_batch`` transitions per yield; ``reset_at_each_iter``
    ends every env's episode (marked truncated) at its next step after each
    batch; ``post_collect_hook(batch)`` sees every batch before replay or
    the caller; ``driver_affinity`` pins the driver-side threads (the
    server thread, thread workers, the replay writer) to those CPUs;
    ``stall_timeout`` (seconds, None: off) turns a wait for transitions that never come into a
    :class:`CollectorError` naming what each worker waits on; ``step_timeout`` (seconds, None: off) does
    the same for a worker that makes no progress that long, in one env step that never returns or frozen
    anywhere else (a hung process worker is killed, then restarted within ``max_restarts``); ``server_step_timeout`` likewise for a server that
    makes no progress while requests wait (a server process is killed, then
    restarted within ``server_restarts``); ``lockstep`` collects each batch only
    when asked for, every env its share, served by the weights published
    before (:mod:`components.collector.lockstep`: reproducible runs);
    ``dense_successors=False`` leaves ``("next", "observation")`` out of the
    batches and gives the successors of cut trajectories only
    (:mod:`components.successors`, for a trainer like PPO that
    reads no other; kept dense when replay, a post-processor, a hook or
    trajectory grouping reads the batches). A Dict/Tuple observation's leaves are nested keys of the
    batch (views of the packed rows); ``nest_trees=False`` keeps the rows (a Ray host: its driver nests).

    Example::

        collector = AsyncBatchedCollector(GymEnvFactory("CartPole-v1"), ModelSpec("components.models.ActorCritic"),
            GraphSpec(workers="process", server="process", num_envs=64, envs_per_worker=32, chunk_len=64),
            frames_per_batch=4096, total_frames=1_000_000)
        for batch in collector:  # dense TensorDicts of 4096 transitions
            trainer.update(batch, frames=collector.frames)
            collector.update_policy_weights_(trainer.model, version=trainer.policy_version)
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
        initial_frames: int = 0,
        seed: int = 0,
        server_config: ServerConfig | None = None,
        interaction_mode: Any = InteractionMode.RANDOM,
        env_spec: EnvSpec | None = None,
        replay_buffer: Any = None,
        postproc: Callable[[Any], Any] | None = None,
        on_batch: Callable[[Any], None] | None = None,
        storing_device: str = "cpu",
        policy_version: int = 0,
        stall_timeout: float | None = 60.0,
        step_timeout: float | None = 60.0,
        server_step_timeout: float | None = 60.0,
        max_restarts: int = 0,
        restart_window: float = 300.0,
        server_restarts: int = 0,
        skip_non_finite: bool = False,
        yield_completed_trajectories: bool = False,
        reset_at_each_iter: bool = False,
        post_collect_hook: Callable[[Any], None] | None = None,
        driver_affinity: Sequence[int] | None = None,
        lockstep: bool = False,
        dense_successors: bool = True,
        nest_trees: bool = True,
    ) -> None:
        super().__init__(frames_per_batch=frames_per_batch, total_frames=total_frames, initial_frames=initial_frames,
                         replay_buffer=replay_buffer, postproc=postproc, on_batch=on_batch,
                         yield_completed_trajectories=yield_completed_trajectories,
                         post_collect_hook=post_collect_hook,
                         writer_affinity=list(driver_affinity) if driver_affinity else None)
        for name, value in (("stall_timeout", stall_timeout), ("step_timeout", step_timeout),
                            ("server_step_timeout", server_step_timeout)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        problem = graph.chunk_budget_problem(frames_per_batch)
        if problem is not None:
            raise ValueError(f"chunks_per_worker={graph.chunks_per_worker}: {problem}")
        if lockstep and (problem := lockstep_problem(graph, frames_per_batch, total_frames, max_restarts)):
            raise ValueError(f"lockstep collection: {problem}")
        self.graph = graph
        self.env_factory = env_factory
        self.model_spec = model_spec
        self.interaction_mode = InteractionMode.parse(interaction_mode)
        self.server_config = server_config or ServerConfig()
        self.env_spec = env_spec or probe_env_spec(env_factory)
        self.storing_device = torch.device(storing_device)
        self.reset_at_each_iter = reset_at_each_iter
        self.start_timeout = 120.0
        self._seed = seed
        self.skip_non_finite = bool(skip_non_finite)
        self.dense_successors = dense_successors or reads_every_row(
            replay=replay_buffer is not None, postproc=postproc is not None, hook=post_collect_hook is not None,
            trajectories=bool(yield_completed_trajectories))
        self._obs_leaves = self.env_spec.obs_leaves if nest_trees else ()  # a one-leaf env's are ()
        self._initial_version = int(policy_version)
        self._driver_affinity = list(driver_affinity) if driver_affinity else None
        self._mp = mp.get_context("spawn")
        self._server_lock = threading.RLock()  # a server restart vs. a weights push from another thread
        self._names_released = False  # the semaphore names were dropped (see _release_names)
        self._at_exit: Any = None  # the at-exit shutdown, registered by start()
        self._build(stall_timeout, step_timeout, server_step_timeout, lockstep)
        self._restarts = WorkerRestarts(self, int(max_restarts), float(restart_window), int(server_restarts))
        self._monitor.restart = self._restarts if max_restarts > 0 else None
        self._monitor.restart_server = self._restarts.restart_server if server_restarts > 0 else None

    # ------------------------------------------------------------------ build
    def _build(self, stall_timeout: float | None, step_timeout: float | None,
               server_step_timeout: float | None, lockstep: bool) -> None:
        g = self.graph
        served = self.model_spec.build(self.env_spec).eval()
        self.layout = derive_layout(served, self.env_spec.observation_field(), self.env_spec.zero_observation(),
                                    self.env_spec.obs_leaves)
        rows = self._rows = g.worker_rows()
        worker_ctx: Any = self._mp if g.workers == "process" else threading
        server_ctx: Any = self._mp if g.server == "process" else threading
        self._pool = ChunkPool(
            transition_fields(self.env_spec.observation_field(), self.layout.response, self.layout.state),
            rows=rows, chunk_len=g.chunk_len, chunks_per_worker=g.chunks_per_worker_for(self.frames_per_batch),
            # one copy per frame (see ChunkPool); concurrent envs fill rows in the order they return, not by step
            ctx=worker_ctx, stream=None if g.concurrent_envs else "observation",
            dense_successor=self.dense_successors,
        )
        self._assembler = BatchAssembler(self._pool, self._next_chunk, obs_leaves=self._obs_leaves)
        self._control = WorkerControl(len(rows))
        self._lockstep = Lockstep(self._control.granted, g.num_envs, self._initial_version) if lockstep else None
        # One request slot per block; a worker owns ``splits`` of them.
        self._splits = [g.split_sizes(r) for r in rows]
        slot_rows = max(max(sizes) for sizes in self._splits)
        num_slots = sum(len(sizes) for sizes in self._splits)
        self._slots_shape = (num_slots, slot_rows, worker_ctx if worker_ctx is not threading else server_ctx)
        self._template = served.state_dict()
        self._slots, self.server, self._channels = self._server_side(self._initial_version)
        self.workers: Any = (ProcessWorkers(self._mp, g.worker_nice, g.worker_threads) if g.workers == "process"
                             else ThreadWorkers(self._driver_affinity))
        spans = [(sum(rows[:i]), sum(rows[:i + 1]) - 1) for i in range(len(rows))]  # each worker's first, last env
        self._monitor = GraphMonitor(self._control, self.workers, self.server, spans, stall_timeout, step_timeout,
                                     server_step_timeout)

    def _server_side(self, version: int) -> tuple[SlotTransport | None, Any, list[list[Any]]]:
        """A fresh transport, a server for it (not started) and every block's client.

        ``server=inline`` has no transport: the "server" only publishes
        weights and reads statistics, and each worker's channels answer
        with the worker's own copy of the policy.
        """
        if self.graph.server == "inline":
            ctx = self._mp if self.graph.workers == "process" else threading
            inline = InlineServer(self.model_spec, self.env_spec, self.server_config, len(self._rows), ctx,
                                  self._template, version)
            observation = self.env_spec.observation_field()
            return None, inline, [inline.channels(w, sizes, observation) for w, sizes in enumerate(self._splits)]
        num_slots, slot_rows, ctx = self._slots_shape
        slots = SlotTransport(self.layout, num_slots=num_slots, rows_per_slot=slot_rows, ctx=ctx)
        server = InferenceServer(
            self.model_spec, slots, self.server_config, env_spec=self.env_spec, placement=self.graph.server,
            policy_version=version, ctx=self._mp, template=self._template,
            affinity=self._driver_affinity if self.graph.server == "thread" else None,
        )
        return slots, server, [[slots.client() for _ in sizes] for sizes in self._splits]

    def _worker_channels(self, w: int) -> list[Any]:
        """Fresh action channels for a relaunched worker ``w`` (its request slots, or a new policy copy)."""
        if self._slots is None:
            self._channels[w] = self.server.channels(w, self._splits[w], self.env_spec.observation_field())
            return self._channels[w]
        return [self._slots.client(ch.slot) for ch in self._channels[w]]

    def _release_names(self, pool: bool = True) -> None:
        """Drop the semaphore names once every process opened them, unless a relaunched process needs them.

        With the names gone a SIGKILL of the whole group leaves nothing in /dev/shm; a run that may relaunch
        worker processes keeps them (the runner sweeps dead runs' pid-named semaphores). A restarted server
        gets a new transport and weights channel, so after a server restart only the new names are dropped
        (``pool=False``): dropping one twice makes the resource tracker print a traceback per name.
        """
        if self.graph.workers == "thread" or not self._restarts.may_relaunch_workers:
            release_semaphore_names(self._slots, self._pool if pool else None, self.server.weights_channel)
            self._names_released = True

    # -------------------------------------------------------------- lifecycle
    def start(self) -> AsyncBatchedCollector:
        """Start the server and the workers; idempotent.

        With a ``replay_buffer`` it also starts the writer thread, which
        extends the buffer with every batch until ``total_frames``, so
        collection goes on while a trainer samples.
        """
        if self._started:
            return self
        if self._closed:
            raise RuntimeError("this collector was shut down; build a new one")
        self._started = True
        self._at_exit = shutdown_at_exit(self)  # a script that ends or raises without shutdown() still exits
        try:
            try:
                self.server.start()
            except ServerError as err:
                raise CollectorError(str(err)) from None
            seeds = env_seeds(self._seed, self.graph.num_envs)
            assignments, first = [], 0
            for w, r in enumerate(self._rows):
                ids = tuple(range(first, first + r))
                assignments.append(WorkerAssignment(w, ids, tuple(seeds[i] for i in ids), self._splits[w],
                                                    skip_non_finite=self.skip_non_finite,
                                                    concurrent=self.graph.concurrent_envs))
                first += r
            affinity = [list(a) for a in self.graph.worker_affinity] if self.graph.worker_affinity else None
            self.workers.start(
                assignments, self.env_factory, self._channels,
                [self._pool.writer(w) for w in range(len(self._rows))],
                self._control, int(self.interaction_mode), self.layout.response_keys, affinity,
            )
            self._monitor.wait_for(RUNNING, self.start_timeout)  # start-up errors surface here
            self._release_names()  # every process has opened the shared semaphores by now
            self._monitor.mark()
            self._monitor.watch_driver()
            if self.replay_buffer is not None:
                self._writer.start(self._batches())
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop workers and server, and join them all (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._at_exit is not None:
            self._at_exit.cancel()
        self._writer.stopping()
        self._control.stop[:] = 1
        self._control.pause[0] = 0
        if self._started:
            self.workers.join(timeout)
        self._writer.join(timeout)
        self.server.shutdown(timeout)
        self._monitor.stop_watching()

    # ------------------------------------------------------------- iteration
    def _next_chunk(self) -> int:
        waiting_since = time.monotonic()
        while True:
            if self._closed:
                raise CollectorError("the collector was shut down")
            gid = self._pool.next_ready(_POLL_S)
            if gid is not None:
                return gid
            self._monitor.check_health()
            if self._control.pause[0]:
                waiting_since = time.monotonic()  # a pause is not a stall
            self._monitor.check_stall(waiting_since)

    def next_batch(self, frames: int | None = None) -> Any:
        """Assemble the next batch of ``frames`` transitions (default ``frames_per_batch``)."""
        n = frames or self.frames_per_batch
        version = self._lockstep.grant(n) if self._lockstep is not None else None
        flat = self._assembler.next_batch(n)
        if version is not None:
            flat = self._lockstep.order(flat, version)
        self._frames += n
        # Checked on every batch, not only when chunks stop: other workers may keep
        # the chunks coming while one of them is dead.
        self._monitor.check_health()
        if self.reset_at_each_iter:
            self._control.reset_epoch[0] += 1
        batch = TensorDict(nest(flat, self._obs_leaves), batch_size=[n])
        if self._assembler.cut_successors is not None:
            batch.set_non_tensor(CUT_SUCCESSORS_KEY, self._assembler.cut_successors)
        return batch if self.storing_device.type == "cpu" else batch.to(self.storing_device, non_blocking=True)

    # ---------------------------------------------------------------- control
    def update_policy_weights_(self, weights: torch.nn.Module | Mapping[str, torch.Tensor],
                               version: int | None = None) -> int:
        """Publish weights labelled ``version`` (default: the last + 1), applied between two batches; returns it.

        Weights published before :meth:`start` are served from the first request.
        """
        with self._server_lock:
            if self._started and not self._closed and not self.server.is_alive:
                self._monitor.check_health()  # restart it (or raise) before publishing to a dead one
            try:
                published = self.server.update_weights(weights, version)
            except WeightsLockError as err:
                raise CollectorError(f"inference server ({self.server.backend}) died: {err}") from None
            if self._lockstep is not None:  # the version the next batch must be served by
                self._lockstep.published = published
            return published

    @property
    def num_workers(self) -> int:
        return len(self._rows)

    @property
    def policy_version(self) -> int:
        """The version the server stamps on its responses now."""
        return self.server.policy_version

    def server_stats(self, reset: bool = True) -> dict[str, float]:
        """Server statistics since the last ``reset`` read (:class:`~components.inference.stats.ServerStats`).

        The ``*_total`` counters go on across a server restart (what the dead server served since the last
        read is lost with it).
        """
        with self._server_lock:
            out = self.server.stats(reset=reset)
        for key, before in self._restarts.server_totals.items():
            if key in out:
                out[key] += before
        return out

    def worker_stats(self) -> dict[str, Any]:
        """Where worker time went since the last call (see :meth:`GraphMonitor.worker_stats`), and restarts."""
        out = self._monitor.worker_stats()
        if out:
            out["worker_restarts"] = self._restarts.count
            out["server_restarts"] = self._restarts.server_count
        return out

    @contextlib.contextmanager
    def pause(self, timeout: float = 30.0) -> Iterator[None]:
        """Quiesce env workers, the server and the replay writer for the block.

        Workers park at a step boundary, after their last request was answered; transitions already in
        chunks stay there, in order; the writer finishes the extend it is in and waits. Everything resumes
        where it stopped: no transition is lost or written twice.
        """
        if not self._started or self._closed:
            yield
            return
        with self._monitor.paused(self._writer.lock, timeout):
            yield
