"""Env hosts on a Ray cluster as a source of chunks: launch, place, ask, take in order, replace.

Each host (:class:`~components.ray.host.EnvHost`, one Ray actor) steps its
block of envs with its own policy copy and answers ``collect`` calls with a
dense chunk of ``chunk_len`` steps of every env it holds. :class:`HostChunks`
keeps one to ``in_flight`` calls outstanding per host, as many as keep one
batch made ahead of the trainer (see :meth:`HostChunks.top_up`), takes chunks
in the order they finish (a host's chunks in the order it produced them) and
queues them for :class:`~components.collector.assembly.ChunkQueue` to cut. A
round trip to an actor costs about a millisecond here, so nothing is ever
asked per step.

Faults: a host whose process dies (killed, node lost) or whose local
collector fails (an env crash, a hung step past ``step_timeout``) fails the
run with ``ray worker N on node X: <cause>``, or, within the restart budget,
is replaced by a host with fresh envs for the same env ids, whose
``env_step`` continues past a gap so GAE and n-step returns cut the
trajectories there. A failure's kind (:mod:`components.collector.failures`)
decides, never its words.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from components.collector.assembly import ChunkQueue
from components.collector.failures import CollectorError, Failure, RestartBudget
from components.env_set import EnvSet
from components.envs import env_seeds
from components.ray.cluster import RayCluster
from components.ray.errors import ray_failure
from components.ray.host import LOCAL_CHUNKS, HostSpec, remote_host_class
from components.ray.hosts_spec import RayHostsSpec

_POLL_S = 0.25


@dataclass(frozen=True)
class HostBuild:
    """What every host is built from (the same for a relaunch), and the local collector's options."""

    env_factory: Callable[[], Any]
    model_spec: Any
    env_spec: Any
    server_config: Any
    seed: int
    interaction_mode: int
    stall_timeout: float | None
    step_timeout: float | None
    skip_non_finite: bool


class _Host:
    """The driver's view of one host: its actor, the calls in flight, where it runs."""

    def __init__(self, spec: HostSpec, actor: Any) -> None:
        self.spec, self.actor = spec, actor
        self.refs: collections.deque[Any] = collections.deque()
        self.node = "?"
        self.node_label = "?"
        self.pid: int | None = None
        self.step_offset = 0  # added to env_step of a relaunched host: the gap cuts trajectories
        self.last_step = -1
        self.seq = 0  # the last chunk passed on
        self.early: dict[int, tuple[dict[str, np.ndarray], dict[str, float]]] = {}  # chunks ahead of their turn
        self.stats: dict[str, float] = {}


class HostChunks:
    """The hosts ``spec`` lays out on ``cluster``, queueing their chunks in ``queue`` for batches of ``frames_per_batch``."""

    def __init__(self, ray: Any, cluster: RayCluster, spec: RayHostsSpec, build: HostBuild, *,
                 frames_per_batch: int, budget: RestartBudget) -> None:
        self.ray, self.cluster, self.spec, self.build = ray, cluster, spec, build
        self.frames_per_batch, self.budget = frames_per_batch, budget
        self.queue = ChunkQueue()
        self.hosts: list[_Host] = []
        self._owner: dict[Any, int] = {}  # in-flight ref -> host index
        self.paused = self.closed = False
        self.lock = threading.RLock()  # the replay writer receives while the trainer publishes or pauses
        self.launches = 0  # every relaunch draws new env seeds
        self.last_chunk = time.monotonic()
        self.acting_version = 0
        self.node_frames: dict[str, int] = {}
        # what bounds one driver: its CPU per chunk received, bytes per transition
        self.driver_cpu_s = 0.0
        self.chunk_bytes = self.chunk_frames = 0
        self._remote_cls = remote_host_class(ray)

    # -------------------------------------------------------------- lifecycle
    def _host_spec(self, i: int, launch: int) -> HostSpec:
        h, b = self.spec, self.build
        first = h.first_envs()[i]
        # launch 0 draws the run's env seeds; a relaunch draws fresh ones (the same episodes again would bias)
        seed = env_seeds(b.seed, h.num_envs)[first] if launch == 0 else \
            int(np.random.SeedSequence([b.seed, i, launch]).generate_state(1)[0])
        return HostSpec(index=i, first_env=first, num_envs=h.rows[i], chunk_len=h.chunk_len, seed=int(seed),
                        local_workers=h.local_workers, cpus=max(1, int(h.cpus_per_host)),
                        interaction_mode=b.interaction_mode, stall_timeout=b.stall_timeout,
                        step_timeout=b.step_timeout, skip_non_finite=b.skip_non_finite)

    def _launch(self, i: int, launch: int, weights_ref: Any, version: int) -> _Host:
        h, b = self.spec, self.build
        options: dict[str, Any] = {"num_cpus": h.cpus_per_host, "max_restarts": 0}
        if h.resources:
            options["resources"] = dict(h.resources)
        if h.scheduling != "DEFAULT":  # "SPREAD": hosts on as many nodes as possible
            options["scheduling_strategy"] = h.scheduling
        spec = self._host_spec(i, launch)
        # an env set: the host builds its own range of env ids, each with its task's factory and seed offset
        factory = b.env_factory.slice(spec.first_env, spec.num_envs) if isinstance(b.env_factory, EnvSet) \
            else b.env_factory
        actor = self._remote_cls.options(**options).remote(
            spec, factory, b.model_spec, b.env_spec, b.server_config, weights_ref, version)
        return _Host(spec, actor)

    def launch_all(self, weights_ref: Any, version: int) -> None:
        """Start every host with these weights and wait until each runs (placement and envs built)."""
        self.acting_version = int(version)
        self.hosts = [self._launch(i, 0, weights_ref, version) for i in range(self.spec.num_hosts)]
        self._placed(self.hosts, self.spec.start_timeout)
        self.last_chunk = time.monotonic()

    def _placed(self, hosts: list[_Host], timeout: float) -> None:
        """Wait for every host to be built and say where it runs; fail in one line otherwise."""
        refs = {h.actor.where.remote(): h for h in hosts}
        deadline = time.monotonic() + timeout
        waiting = list(refs)
        while waiting:
            ready, waiting = self.ray.wait(waiting, num_returns=1,
                                           timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            for ref in ready:
                host = refs[ref]
                try:
                    where = self.ray.get(ref)
                except Exception as err:  # noqa: BLE001 - any failure of a host's build is the run's error
                    failure = self.describe(host, err)
                    raise CollectorError(failure.message, failure.kind) from None
                host.node, host.pid = str(where["node_id"]), int(where["pid"])
                host.node_label = host.node[:8]
            if waiting and time.monotonic() > deadline:
                h = self.spec
                idle = ", ".join(str(refs[r].spec.index) for r in waiting)
                raise CollectorError(
                    f"ray worker(s) {idle} not running after {timeout:g} s: the cluster cannot place {h.num_hosts} "
                    f"host(s) of {h.cpus_per_host:g} CPU(s){' and ' + str(h.resources) if h.resources else ''} "
                    f"({self.cluster.total_cpus():g} CPU(s) in the cluster); lower ray.num_actors or "
                    f"ray.num_cpus_per_actor, or raise ray.start_timeout")

    def kill_all(self) -> None:
        """Kill every host started (idempotent); chunks in flight are written off."""
        self.closed = True
        for host in self.hosts:
            with contextlib.suppress(Exception):
                self.ray.kill(host.actor, no_restart=True)
        self._owner.clear()

    def where(self) -> list[dict[str, Any]]:
        """Every host: its index, env ids, node and process."""
        return [{"host": h.spec.index, "envs": (h.spec.first_env, h.spec.first_env + h.spec.num_envs - 1),
                 "node_id": h.node, "pid": h.pid} for h in self.hosts]

    def describe(self, host: _Host, err: BaseException) -> Failure:
        """``ray worker N on node X: cause`` in one line, and the cause's kind."""
        what = ray_failure(err, self.ray.exceptions)
        return Failure(f"ray worker {host.spec.index} on node {host.node_label} (pid {host.pid}): {what.message}",
                       what.kind)

    @property
    def in_flight(self) -> int:
        return len(self._owner)

    # -------------------------------------------------------------- chunks
    def _request(self, i: int) -> None:
        host = self.hosts[i]
        ref = host.actor.collect.remote()
        host.refs.append(ref)
        self._owner[ref] = i

    def top_up(self) -> None:
        """Ask for chunks while the frames made ahead of the trainer stay within one batch (backpressure).

        A transition's policy lag is about the frames made before the
        trainer's next weights arrive, divided by ``frames_per_batch``. Made
        ahead: the chunks queued here, the chunks requested, and the chunks a
        host's local buffers fill whether asked or not (``LOCAL_CHUNKS`` each,
        one of which the next request takes). Every host keeps one request out
        (its local buffer hides the round trip), at most ``in_flight``.
        Measured on CartPole, 2 hosts of 64-transition chunks, 256 frames per
        batch, seeds 1-5: ``in_flight`` requests always out ran two batches
        ahead (lag 2.0-2.1, 14.6k frames/s, unsolved at 100k frames in 1 of 4
        seeds); this rule: lag 1.6, 11-12k frames/s, all 5 solved at 49-75k
        frames (local workers: lag 1.26, 46-58k frames).
        """
        with self.lock:
            if self.paused or self.closed or self.queue.frames >= self.frames_per_batch:
                return
            ahead = self.queue.frames + sum(len(h.refs) * h.spec.chunk_frames for h in self.hosts)
            ahead += sum(max(0, LOCAL_CHUNKS - 1) * h.spec.chunk_frames for h in self.hosts)
            for i, host in enumerate(self.hosts):
                if not host.refs:
                    self._request(i)
                    ahead += host.spec.chunk_frames
            asked = True
            while asked:
                asked = False
                for i, host in enumerate(self.hosts):
                    if len(host.refs) < self.spec.in_flight and ahead + host.spec.chunk_frames <= self.frames_per_batch:
                        self._request(i)
                        ahead += host.spec.chunk_frames
                        asked = True

    def receive(self, stall_timeout: float | None, weights: Callable[[], tuple[Any, int]]) -> None:
        """Take in whatever finished within a poll; fail or replace hosts that broke; check for a stall.

        ``weights`` gives the latest published weights (a reference and its
        version), for a host that replaces a failed one.
        """
        with self.lock:
            self.top_up()
            waiting = list(self._owner)
        if not waiting:
            raise CollectorError("the collector was shut down" if self.closed else "no chunk requests in flight")
        ready, _ = self.ray.wait(waiting, num_returns=1, timeout=_POLL_S)
        if not ready:
            if stall_timeout is not None and time.monotonic() - self.last_chunk > stall_timeout:
                hosts = ", ".join(f"{h.spec.index}@{h.node_label}" for h in self.hosts)
                raise CollectorError(f"no chunk from any ray worker for {stall_timeout:g} s "
                                     f"(collector.stall_timeout); hosts {hosts}")
            return
        cpu = time.thread_time()
        try:
            self._take_ready(ready[0], weights)
        finally:
            self.driver_cpu_s += time.thread_time() - cpu

    def _take_ready(self, done: Any, weights: Callable[[], tuple[Any, int]]) -> None:
        with self.lock:
            i = self._owner.get(done)
            if i is None:
                return  # a failed host's call, already written off
            host = self.hosts[i]
            # A host runs its collect calls one at a time: the ones asked before this are done or next in line.
            while host.refs:
                ref = host.refs.popleft()
                del self._owner[ref]
                try:
                    seq, fields, stats = self.ray.get(ref)
                except Exception as err:  # noqa: BLE001 - a dead or failed host, whatever Ray wraps it in
                    self._host_failed(i, err, *weights())
                    return
                self._take_chunk(host, seq, fields, stats)
                if ref == done:
                    break
            self.top_up()

    def _take_chunk(self, host: _Host, seq: int, fields: dict[str, np.ndarray], stats: dict[str, float]) -> None:
        # A threaded actor may run two queued calls out of order: chunks go on in the order the host made them.
        host.early[seq] = (fields, stats)
        while host.seq + 1 in host.early:
            host.seq += 1
            self._append_chunk(host, *host.early.pop(host.seq))

    def _append_chunk(self, host: _Host, fields: dict[str, np.ndarray], stats: dict[str, float]) -> None:
        if host.step_offset:
            fields["env_step"] = fields["env_step"] + host.step_offset
        host.last_step = max(host.last_step, int(fields["env_step"].max()))
        n = len(fields["env_index"])
        self.chunk_bytes += sum(v.nbytes for v in fields.values())
        self.chunk_frames += n
        self.queue.append(fields)
        self.node_frames[host.node_label] = self.node_frames.get(host.node_label, 0) + n
        host.stats = stats
        self.acting_version = max(self.acting_version, int(fields["policy_version"].max()))
        self.last_chunk = time.monotonic()

    def _host_failed(self, i: int, err: BaseException, weights_ref: Any, version: int) -> None:
        host = self.hosts[i]
        failure = self.describe(host, err)
        for ref in host.refs:
            self._owner.pop(ref, None)
        host.refs.clear()
        with contextlib.suppress(Exception):
            self.ray.kill(host.actor, no_restart=True)
        nth = self.budget.admit(i, failure)  # raises when the same again would fail the same way, or past it
        self.launches += 1
        print(f"warning: {failure.message}; restarting it with fresh envs (restart {nth} of "
              f"{self.budget.max_restarts} within {self.budget.window:g} s)", flush=True)
        fresh = self._launch(i, self.launches, weights_ref, version)
        fresh.step_offset = host.last_step + 2 if host.last_step >= 0 else 0
        self.hosts[i] = fresh
        self._placed([fresh], self.spec.start_timeout)

    # ------------------------------------------------------------- control
    def publish(self, weights_ref: Any, version: int) -> None:
        """Send one weights reference to every host (errors surface with its next chunk)."""
        for host in self.hosts:
            host.actor.set_weights.remote(weights_ref, version)

    def on_hosts(self, method: str, arg: float | None, timeout: float) -> None:
        """Call a control method on every host and wait for all (dead hosts are left to :meth:`receive`)."""
        calls = {getattr(h.actor, method).remote(*([] if arg is None else [arg])): h for h in self.hosts}
        ready, waiting = self.ray.wait(list(calls), num_returns=len(calls), timeout=timeout + 5.0)
        if waiting:
            raise TimeoutError(f"{len(waiting)} ray worker(s) did not {method} within {timeout:g} s")
        for ref in ready:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                pass  # dead: its pending chunk requests say so
            except Exception as err:  # noqa: BLE001 - the host's own failure, in one line
                failure = self.describe(calls[ref], err)
                raise CollectorError(failure.message, failure.kind) from None

    def host_stats(self, prefix: str) -> list[dict[str, float]]:
        """Each host's statistics of its latest chunk under ``prefix`` (``server/`` or ``worker/``), prefix removed."""
        return [{k.removeprefix(prefix): v for k, v in h.stats.items() if k.startswith(prefix)}
                for h in self.hosts if h.stats]
