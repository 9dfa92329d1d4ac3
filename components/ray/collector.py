"""RayCollector: env hosts on a Ray cluster feeding one driver, with the local collector's batch contract.

What is specific to Ray lives in :mod:`components.ray.chunk_source` (the
hosts as a source of chunks: launch, placement, requests and their
backpressure, order, replacement within the shared restart budget); this
module cuts exact ``frames_per_batch`` batches from its queue, publishes
weights and reports statistics, with the stream machinery every collector
shares (:class:`~components.collector.stream.BatchStream`).

Weights go out once per update: one ``ray.put`` of numpy arrays and one
``set_weights`` call per host with the reference and the version, applied
on the host's control thread at once. The policy lag is about what was made
ahead (one batch and a chunk per host), and every transition says which
version acted. Shutdown kills every host it started.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from components.collector.assembly import nest
from components.collector.failures import CollectorError, RestartBudget
from components.collector.stream import BatchStream
from components.envs import EnvSpec, probe_env_spec
from components.inference.loop import ServerConfig
from components.interaction import InteractionMode
from components.models import ModelSpec
from components.ray.chunk_source import HostBuild, HostChunks
from components.ray.cluster import RayCluster, import_ray
from components.ray.host import numpy_weights
from components.ray.host_stats import combine_host_stats
from components.ray.hosts_spec import RayHostsSpec, split_envs

__all__ = ["RayCollector", "RayHostsSpec", "split_envs"]


class RayCollector(BatchStream):
    """Dense batches of exactly ``frames_per_batch`` transitions from env hosts on a Ray cluster.

    The same contract and options as
    :class:`~components.collector.collector.AsyncBatchedCollector` where they
    apply (``replay_buffer``/``postproc``/``on_batch``, trajectories, the
    batch hook, ``stall_timeout``, restarts); ``cluster`` must be connected.
    :meth:`pause` stops new chunk requests and the replay writer; hosts fill
    their local buffers meanwhile (they are not parked remotely).
    """

    def __init__(
        self,
        env_factory: Callable[[], Any],
        model_spec: ModelSpec,
        hosts: RayHostsSpec,
        cluster: RayCluster,
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
        max_restarts: int = 0,
        restart_window: float = 300.0,
        skip_non_finite: bool = False,
        yield_completed_trajectories: bool = False,
        post_collect_hook: Callable[[Any], None] | None = None,
        driver_affinity: Sequence[int] | None = None,
        on_start: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        super().__init__(frames_per_batch=frames_per_batch, total_frames=total_frames, initial_frames=initial_frames,
                         replay_buffer=replay_buffer, postproc=postproc, on_batch=on_batch,
                         yield_completed_trajectories=yield_completed_trajectories,
                         post_collect_hook=post_collect_hook,
                         writer_affinity=list(driver_affinity) if driver_affinity else None)
        self.ray = import_ray()
        self.cluster, self.hosts_spec = cluster, hosts
        self.model_spec = model_spec
        self.env_spec = env_spec or probe_env_spec(env_factory)
        self.storing_device = torch.device(storing_device)
        self.stall_timeout = stall_timeout
        self._version = int(policy_version)
        self._weights_ref: Any = None
        build = HostBuild(env_factory, model_spec, self.env_spec, server_config or ServerConfig(), int(seed),
                          int(InteractionMode.parse(interaction_mode)), stall_timeout, step_timeout,
                          bool(skip_non_finite))
        self._source = HostChunks(self.ray, cluster, hosts, build, frames_per_batch=frames_per_batch,
                                  budget=RestartBudget(max_restarts, restart_window))
        self._source.acting_version = self._version
        self._broadcast_s: list[float] = []  # weights broadcasts since the last worker_stats read
        self._mark = (0.0, 0)  # (driver CPU, frames) at the last worker_stats read
        self._on_start = on_start  # sees :meth:`where` once every host runs (the runner prints the placement)

    @property
    def restarts(self) -> int:
        """Hosts replaced after a crash, over the run."""
        return self._source.budget.count

    # -------------------------------------------------------------- lifecycle
    def start(self) -> RayCollector:
        if self._started:
            return self
        if self._closed:
            raise RuntimeError("this collector was shut down; build a new one")
        self._started = True
        try:
            if self._weights_ref is None:
                served = self.model_spec.build(self.env_spec)
                self._publish(numpy_weights(served.state_dict()), self._version)
            self._source.launch_all(self._weights_ref, self._version)
            if self._on_start is not None:
                self._on_start(self.where())
            self._source.top_up()
            if self.replay_buffer is not None:
                self._writer.start(self._batches())
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the replay writer and kill every host (idempotent); the cluster itself is the caller's."""
        if self._closed:
            return
        self._closed = True
        self._writer.stopping()
        self._source.kill_all()
        self._writer.join(timeout)

    def where(self) -> list[dict[str, Any]]:
        """Every host: its index, env ids, node and process (after :meth:`start`)."""
        return self._source.where()

    # ------------------------------------------------------------- batches
    def next_batch(self, frames: int | None = None) -> Any:
        """Assemble the next batch of ``frames`` transitions (default ``frames_per_batch``) from whole chunks."""
        from tensordict import TensorDict

        if not self._started:
            self.start()
        n = frames or self.frames_per_batch
        source = self._source
        while source.queue.frames < n:
            if self._closed:
                raise CollectorError("the collector was shut down")
            source.receive(self.stall_timeout, lambda: (self._weights_ref, self._version))
        cpu = time.thread_time()
        with source.lock:
            flat = source.queue.take(n)
            source.top_up()
        self._frames += n
        batch = TensorDict(nest(flat, self.env_spec.obs_leaves), batch_size=[n])
        source.driver_cpu_s += time.thread_time() - cpu
        return batch if self.storing_device.type == "cpu" else batch.to(self.storing_device, non_blocking=True)

    # ------------------------------------------------------------- control
    def _publish(self, weights: dict[str, np.ndarray], version: int) -> None:
        self._version = int(version)
        self._weights_ref = self.ray.put(weights)  # once per update, whatever the number of hosts

    def update_policy_weights_(self, weights: torch.nn.Module | Mapping[str, torch.Tensor],
                               version: int | None = None) -> int:
        """Publish weights labelled ``version`` (default: the last + 1) to every host; returns it."""
        started = time.perf_counter()
        state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
        version = self._version + 1 if version is None else int(version)
        self._publish(numpy_weights(state), version)
        if self._started and not self._closed:
            self._source.publish(self._weights_ref, version)
        self._broadcast_s.append(time.perf_counter() - started)
        return version

    @property
    def policy_version(self) -> int:
        """The newest version that acted in a chunk received so far (the initial one before any)."""
        return self._source.acting_version

    def server_stats(self, reset: bool = True) -> dict[str, float]:
        """The hosts' inline inference statistics of their latest chunks: counts and rates summed, the rest averaged."""
        return combine_host_stats(self._source.host_stats("server/"))

    def worker_stats(self) -> dict[str, Any]:
        """Per-node frames (``ray/node_frames/<node>``), hosts, requests in flight, restarts, hosts' time split."""
        source = self._source
        if not source.hosts:
            return {}
        out: dict[str, Any] = combine_host_stats(source.host_stats("worker/"))
        fracs = {name: out[f"{name}_frac"] for name in ("env", "infer_wait", "chunk_wait") if f"{name}_frac" in out}
        if fracs:
            out["bound"] = max(fracs, key=fracs.get)  # type: ignore[arg-type]
        out.update({f"ray/node_frames/{node}": frames for node, frames in sorted(source.node_frames.items())})
        cpu, frames = source.driver_cpu_s - self._mark[0], source.chunk_frames - self._mark[1]
        self._mark = (source.driver_cpu_s, source.chunk_frames)
        if frames:
            # one driver core takes in at most 1e6 / driver_us_per_frame frames/s
            out["ray/driver_us_per_frame"] = 1e6 * cpu / frames
        if source.chunk_frames:
            out["ray/bytes_per_frame"] = source.chunk_bytes / source.chunk_frames
        if self._broadcast_s:
            out["ray/weights_broadcast_ms"] = 1e3 * float(np.median(self._broadcast_s))
            self._broadcast_s.clear()
        out["ray/hosts"] = len(source.hosts)
        out["ray/nodes"] = len({h.node for h in source.hosts})
        out["ray/in_flight"] = source.in_flight
        out["worker_restarts"] = self.restarts
        return out

    @contextlib.contextmanager
    def pause(self, timeout: float = 30.0) -> Iterator[None]:
        """Park every host's workers at a step boundary, stop chunk requests and replay writes, for the block.

        Chunks already made stay in order; a host that died meanwhile is
        reported (or restarted) by the next chunk request, not here.
        """
        if not self._started or self._closed:
            yield
            return
        if not self._writer.lock.acquire(timeout=timeout):
            raise TimeoutError(f"the replay writer did not pause within {timeout} s")
        self._source.paused = True
        try:
            self._source.on_hosts("pause", timeout, timeout)
            yield
        finally:
            self._source.paused = False
            try:
                self._source.on_hosts("resume", None, timeout)
            finally:
                self._writer.lock.release()
                self._source.top_up()
