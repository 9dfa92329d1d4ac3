"""RayCollector: env hosts on a Ray cluster feeding one driver, with the local collector's batch contract.

Each host (:class:`~components.ray.host.EnvHost`, one Ray actor) steps its
block of envs with its own policy copy and answers ``collect`` calls with a
dense chunk of ``chunk_len`` steps of every env it holds. The driver keeps
one to ``in_flight`` calls outstanding per host, as many as keep one batch
made ahead of the trainer (backpressure that bounds the policy lag; see
:meth:`RayCollector._top_up`), takes chunks in the
order they finish (a host's chunks in the order it produced them), and cuts
exact ``frames_per_batch`` batches from them. A round trip to an actor costs
about a millisecond here, so nothing is ever asked per step.

Weights go out once per update: one ``ray.put`` of numpy arrays and one
``set_weights`` call per host with the reference and the version. A host's
calls run one at a time in submission order, so new weights reach it after
the chunks already requested: the policy lag is about what was made ahead
(one batch and a chunk per host), and every transition says which version acted.

Faults: a host whose process dies (killed, node lost) or whose local
collector fails (an env crash, a hung step past ``step_timeout``) fails the
run with ``ray worker N on node X: <cause>``, or, within ``max_restarts`` per
``restart_window``, is replaced by a host with fresh envs for the same env
ids, whose ``env_step`` continues past a gap so GAE and n-step returns cut
the trajectories there. Shutdown kills every host it started.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from components.collector.assembly import nest
from components.collector.failures import CollectorError, Failure, RestartBudget
from components.collector.stream import BatchStream
from components.envs import EnvSpec, env_seeds, probe_env_spec
from components.inference.loop import ServerConfig
from components.interaction import InteractionMode
from components.models import ModelSpec
from components.ray.cluster import RayCluster, import_ray
from components.ray.errors import ray_failure
from components.ray.host import LOCAL_CHUNKS, HostSpec, numpy_weights, remote_host_class
from components.ray.host_stats import combine_host_stats
from components.ray.hosts_spec import RayHostsSpec, split_envs

__all__ = ["RayCollector", "RayHostsSpec", "split_envs"]
_POLL_S = 0.25
class _Host:
    """The driver's view of one host: its actor, the calls in flight, where it runs."""

    def __init__(self, spec: HostSpec, actor: Any, launch: int) -> None:
        self.spec, self.actor, self.launch = spec, actor, launch
        self.refs: collections.deque[Any] = collections.deque()
        self.node = "?"
        self.node_label = "?"
        self.pid: int | None = None
        self.step_offset = 0  # added to env_step of a relaunched host: the gap cuts trajectories
        self.last_step = -1
        self.seq = 0  # the last chunk passed on
        self.early: dict[int, tuple[dict[str, np.ndarray], dict[str, float]]] = {}  # chunks ahead of their turn
        self.stats: dict[str, float] = {}


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
        self.env_factory, self.model_spec = env_factory, model_spec
        self.env_spec = env_spec or probe_env_spec(env_factory)
        self.server_config = server_config or ServerConfig()
        self.interaction_mode = InteractionMode.parse(interaction_mode)
        self.storing_device = torch.device(storing_device)
        self.stall_timeout, self.step_timeout = stall_timeout, step_timeout
        self.max_restarts, self.restart_window = int(max_restarts), float(restart_window)
        self.skip_non_finite = bool(skip_non_finite)
        self._seed = int(seed)
        self._version = int(policy_version)
        self._acting_version = int(policy_version)
        self._weights: dict[str, np.ndarray] | None = None
        self._weights_ref: Any = None
        self._hosts: list[_Host] = []
        self._owner: dict[Any, int] = {}  # in-flight ref -> host index
        self._pending: collections.deque[dict[str, np.ndarray]] = collections.deque()
        self._pending_frames = 0
        self._paused = False
        # what bounds one driver: its CPU per chunk received and batch cut, bytes per transition, broadcasts
        self._driver_cpu_s = 0.0
        self._chunk_bytes = self._chunk_frames = 0
        self._broadcast_s: list[float] = []
        self._mark = (0.0, 0)  # (driver CPU, frames) at the last worker_stats read
        self._lock = threading.RLock()  # the replay writer receives while the trainer publishes or pauses
        self._budget = RestartBudget(max_restarts, restart_window)
        self._launches = 0
        self.node_frames: dict[str, int] = {}
        self._remote_cls = remote_host_class(self.ray)
        self._on_start = on_start  # sees :meth:`where` once every host runs (the runner prints the placement)

    # -------------------------------------------------------------- lifecycle
    def _host_spec(self, i: int, launch: int) -> HostSpec:
        h = self.hosts_spec
        first = h.first_envs()[i]
        # launch 0 draws the run's env seeds; a relaunch draws fresh ones (the same episodes again would bias)
        seed = env_seeds(self._seed, h.num_envs)[first] if launch == 0 else \
            int(np.random.SeedSequence([self._seed, i, launch]).generate_state(1)[0])
        return HostSpec(index=i, first_env=first, num_envs=h.rows[i], chunk_len=h.chunk_len, seed=int(seed),
                        local_workers=h.local_workers, cpus=max(1, int(h.cpus_per_host)),
                        interaction_mode=int(self.interaction_mode), stall_timeout=self.stall_timeout,
                        step_timeout=self.step_timeout, skip_non_finite=self.skip_non_finite)

    def _launch(self, i: int, launch: int) -> _Host:
        h = self.hosts_spec
        options: dict[str, Any] = {"num_cpus": h.cpus_per_host, "max_restarts": 0}
        if h.resources:
            options["resources"] = dict(h.resources)
        if h.scheduling != "DEFAULT":  # "SPREAD": hosts on as many nodes as possible
            options["scheduling_strategy"] = h.scheduling
        spec = self._host_spec(i, launch)
        actor = self._remote_cls.options(**options).remote(
            spec, self.env_factory, self.model_spec, self.env_spec, self.server_config,
            self._weights_ref, self._version)
        return _Host(spec, actor, launch)

    def _placed(self, hosts: list[_Host], timeout: float) -> None:
        """Wait for every host to be built and say where it runs; fail in one line otherwise."""
        refs = {h.actor.where.remote(): h for h in hosts}
        deadline = time.monotonic() + timeout
        waiting = list(refs)
        while waiting:
            ready, waiting = self.ray.wait(waiting, num_returns=1, timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            for ref in ready:
                host = refs[ref]
                try:
                    where = self.ray.get(ref)
                except Exception as err:  # noqa: BLE001 - any failure of a host's build is the run's error
                    failure = self._describe(host, err)
                    raise CollectorError(failure.message, failure.kind) from None
                host.node, host.pid = str(where["node_id"]), int(where["pid"])
                host.node_label = host.node[:8]
            if waiting and time.monotonic() > deadline:
                h = self.hosts_spec
                idle = ", ".join(str(refs[r].spec.index) for r in waiting)
                raise CollectorError(
                    f"ray worker(s) {idle} not running after {timeout:g} s: the cluster cannot place {h.num_hosts} "
                    f"host(s) of {h.cpus_per_host:g} CPU(s){' and ' + str(h.resources) if h.resources else ''} "
                    f"({self.cluster.total_cpus():g} CPU(s) in the cluster); lower ray.num_actors or "
                    f"ray.num_cpus_per_actor, or raise ray.start_timeout")

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
            self._hosts = [self._launch(i, 0) for i in range(self.hosts_spec.num_hosts)]
            self._placed(self._hosts, self.hosts_spec.start_timeout)
            if self._on_start is not None:
                self._on_start(self.where())
            self._top_up()
            self._last_chunk = time.monotonic()
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
        for host in self._hosts:
            with contextlib.suppress(Exception):
                self.ray.kill(host.actor, no_restart=True)
        self._owner.clear()
        self._writer.join(timeout)

    def where(self) -> list[dict[str, Any]]:
        """Every host: its index, env ids, node and process (after :meth:`start`)."""
        return [{"host": h.spec.index, "envs": (h.spec.first_env, h.spec.first_env + h.spec.num_envs - 1),
                 "node_id": h.node, "pid": h.pid} for h in self._hosts]

    # -------------------------------------------------------------- chunks
    def _request(self, i: int) -> None:
        host = self._hosts[i]
        ref = host.actor.collect.remote()
        host.refs.append(ref)
        self._owner[ref] = i

    def _top_up(self) -> None:
        """Ask for chunks while the frames made ahead of the trainer stay within one batch (backpressure).

        A transition's policy lag is about the frames made before the
        trainer's next weights arrive, divided by ``frames_per_batch``. Made
        ahead: the chunks waiting here, the chunks requested, and the chunks a
        host's local buffers fill whether asked or not (``LOCAL_CHUNKS`` each,
        one of which the next request takes). Every host keeps one request out
        (its local buffer hides the round trip), at most ``in_flight``.
        Measured on CartPole, 2 hosts of 64-transition chunks, 256 frames per
        batch, seeds 1-5: ``in_flight`` requests always out ran two batches
        ahead (lag 2.0-2.1, 14.6k frames/s, unsolved at 100k frames in 1 of 4
        seeds); this rule: lag 1.6, 11-12k frames/s, all 5 solved at 49-75k
        frames (local workers: lag 1.26, 46-58k frames).
        """
        if self._paused or self._closed or self._pending_frames >= self.frames_per_batch:
            return
        ahead = self._pending_frames + sum(len(h.refs) * h.spec.chunk_frames for h in self._hosts)
        ahead += sum(max(0, LOCAL_CHUNKS - 1) * h.spec.chunk_frames for h in self._hosts)
        for i, host in enumerate(self._hosts):
            if not host.refs:
                self._request(i)
                ahead += host.spec.chunk_frames
        asked = True
        while asked:
            asked = False
            for i, host in enumerate(self._hosts):
                if len(host.refs) < self.hosts_spec.in_flight and ahead + host.spec.chunk_frames <= self.frames_per_batch:
                    self._request(i)
                    ahead += host.spec.chunk_frames
                    asked = True

    def _describe(self, host: _Host, err: BaseException) -> Failure:
        """``ray worker N on node X: cause`` in one line, and the cause's kind."""
        what = ray_failure(err, self.ray.exceptions)
        return Failure(f"ray worker {host.spec.index} on node {host.node_label} (pid {host.pid}): {what.message}",
                       what.kind)

    @property
    def restarts(self) -> int:
        """Hosts replaced after a crash, over the run."""
        return self._budget.count

    def _receive(self) -> None:
        """Take in whatever finished within a poll; fail or restart hosts that broke; check for a stall."""
        with self._lock:
            self._top_up()
            waiting = list(self._owner)
        if not waiting:
            raise CollectorError("the collector was shut down" if self._closed else "no chunk requests in flight")
        ready, _ = self.ray.wait(waiting, num_returns=1, timeout=_POLL_S)
        if not ready:
            if self.stall_timeout is not None and time.monotonic() - self._last_chunk > self.stall_timeout:
                hosts = ", ".join(f"{h.spec.index}@{h.node_label}" for h in self._hosts)
                raise CollectorError(f"no chunk from any ray worker for {self.stall_timeout:g} s "
                                     f"(collector.stall_timeout); hosts {hosts}")
            return
        cpu = time.thread_time()
        try:
            self._take_ready(ready[0])
        finally:
            self._driver_cpu_s += time.thread_time() - cpu

    def _take_ready(self, done: Any) -> None:
        with self._lock:
            i = self._owner.get(done)
            if i is None:
                return  # a failed host's call, already written off
            host = self._hosts[i]
            # A host runs its collect calls one at a time: the ones asked before this are done or next in line.
            while host.refs:
                ref = host.refs.popleft()
                del self._owner[ref]
                try:
                    seq, fields, stats = self.ray.get(ref)
                except Exception as err:  # noqa: BLE001 - a dead or failed host, whatever Ray wraps it in
                    self._host_failed(i, err)
                    return
                self._take_chunk(host, seq, fields, stats)
                if ref == done:
                    break
            self._top_up()

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
        self._chunk_bytes += sum(v.nbytes for v in fields.values())
        self._chunk_frames += n
        self._pending.append(fields)
        self._pending_frames += n
        self.node_frames[host.node_label] = self.node_frames.get(host.node_label, 0) + n
        host.stats = stats
        self._acting_version = max(self._acting_version, int(fields["policy_version"].max()))
        self._last_chunk = time.monotonic()

    def _host_failed(self, i: int, err: BaseException) -> None:
        host = self._hosts[i]
        failure = self._describe(host, err)
        for ref in host.refs:
            self._owner.pop(ref, None)
        host.refs.clear()
        with contextlib.suppress(Exception):
            self.ray.kill(host.actor, no_restart=True)
        nth = self._budget.admit(i, failure)  # raises when the same again would fail the same way, or past it
        self._launches += 1
        print(f"warning: {failure.message}; restarting it with fresh envs (restart {nth} of "
              f"{self.max_restarts} within {self.restart_window:g} s)", flush=True)
        fresh = self._launch(i, self._launches)
        fresh.step_offset = host.last_step + 2 if host.last_step >= 0 else 0
        fresh.seq = 0
        self._hosts[i] = fresh
        self._placed([fresh], self.hosts_spec.start_timeout)

    # ------------------------------------------------------------- batches
    def next_batch(self, frames: int | None = None) -> Any:
        """Assemble the next batch of ``frames`` transitions (default ``frames_per_batch``) from whole chunks."""
        from tensordict import TensorDict

        if not self._started:
            self.start()
        n = frames or self.frames_per_batch
        while self._pending_frames < n:
            if self._closed:
                raise CollectorError("the collector was shut down")
            self._receive()
        cpu = time.thread_time()
        parts, taken = [], 0
        while taken < n:
            chunk = self._pending[0]
            size = len(chunk["env_index"])
            want = n - taken
            if size <= want:
                parts.append(self._pending.popleft())
                taken += size
            else:  # the rest of this chunk opens the next batch, in order
                parts.append({k: v[:want] for k, v in chunk.items()})
                self._pending[0] = {k: v[want:] for k, v in chunk.items()}
                taken += want
        with self._lock:
            self._pending_frames -= n
            self._top_up()
        self._frames += n
        flat = {k: torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in parts[0]}
        batch = TensorDict(nest(flat), batch_size=[n])
        self._driver_cpu_s += time.thread_time() - cpu
        return batch if self.storing_device.type == "cpu" else batch.to(self.storing_device, non_blocking=True)

    # ------------------------------------------------------------- control
    def _publish(self, weights: dict[str, np.ndarray], version: int) -> None:
        self._weights, self._version = weights, int(version)
        self._weights_ref = self.ray.put(weights)  # once per update, whatever the number of hosts

    def update_policy_weights_(self, weights: torch.nn.Module | Mapping[str, torch.Tensor],
                               version: int | None = None) -> int:
        """Publish weights labelled ``version`` (default: the last + 1) to every host; returns it."""
        started = time.perf_counter()
        state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
        version = self._version + 1 if version is None else int(version)
        self._publish(numpy_weights(state), version)
        if self._started and not self._closed:
            for host in self._hosts:
                host.actor.set_weights.remote(self._weights_ref, version)  # errors surface with its next chunk
        self._broadcast_s.append(time.perf_counter() - started)
        return version

    @property
    def policy_version(self) -> int:
        """The newest version that acted in a chunk received so far (the initial one before any)."""
        return self._acting_version

    def server_stats(self, reset: bool = True) -> dict[str, float]:
        """The hosts' inline inference statistics of their latest chunks: counts and rates summed, the rest averaged."""
        return combine_host_stats([{k.removeprefix("server/"): v for k, v in h.stats.items() if k.startswith("server/")}
                         for h in self._hosts if h.stats])

    def worker_stats(self) -> dict[str, Any]:
        """Per-node frames (``ray/node_frames/<node>``), hosts, requests in flight, restarts, hosts' time split."""
        if not self._hosts:
            return {}
        out: dict[str, Any] = combine_host_stats([{k.removeprefix("worker/"): v for k, v in h.stats.items()
                                         if k.startswith("worker/")} for h in self._hosts if h.stats])
        fracs = {name: out[f"{name}_frac"] for name in ("env", "infer_wait", "chunk_wait") if f"{name}_frac" in out}
        if fracs:
            out["bound"] = max(fracs, key=fracs.get)  # type: ignore[arg-type]
        out.update({f"ray/node_frames/{node}": frames for node, frames in sorted(self.node_frames.items())})
        cpu, frames = self._driver_cpu_s - self._mark[0], self._chunk_frames - self._mark[1]
        self._mark = (self._driver_cpu_s, self._chunk_frames)
        if frames:
            # one driver core takes in at most 1e6 / driver_us_per_frame frames/s
            out["ray/driver_us_per_frame"] = 1e6 * cpu / frames
        if self._chunk_frames:
            out["ray/bytes_per_frame"] = self._chunk_bytes / self._chunk_frames
        if self._broadcast_s:
            out["ray/weights_broadcast_ms"] = 1e3 * float(np.median(self._broadcast_s))
            self._broadcast_s.clear()
        out["ray/hosts"] = len(self._hosts)
        out["ray/nodes"] = len({h.node for h in self._hosts})
        out["ray/in_flight"] = len(self._owner)
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
        self._paused = True
        try:
            self._on_hosts("pause", timeout, timeout)
            yield
        finally:
            self._paused = False
            try:
                self._on_hosts("resume", None, timeout)
            finally:
                self._writer.lock.release()
                with self._lock:
                    self._top_up()

    def _on_hosts(self, method: str, arg: float | None, timeout: float) -> None:
        """Call a control method on every host and wait for all (dead hosts are left to :meth:`_receive`)."""
        calls = {getattr(h.actor, method).remote(*([] if arg is None else [arg])): h for h in self._hosts}
        ready, waiting = self.ray.wait(list(calls), num_returns=len(calls), timeout=timeout + 5.0)
        if waiting:
            raise TimeoutError(f"{len(waiting)} ray worker(s) did not {method} within {timeout:g} s")
        for ref in ready:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                pass  # dead: its pending chunk requests say so
            except Exception as err:  # noqa: BLE001 - the host's own failure, in one line
                failure = self._describe(calls[ref], err)
                raise CollectorError(failure.message, failure.kind) from None
