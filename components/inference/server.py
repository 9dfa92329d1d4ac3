"""One inference server, run in a thread of the driver or in its own process.

Both placements run the same ``_server_main``: build the policy (from a
:class:`~components.models.ModelSpec` or a module) on the server device,
apply the weights already published, report ready, serve the transport
until told to stop. They share everything else too: weights arrive through
:mod:`components.inference.weights`, statistics travel over a command pipe
answered by a small thread (so the serve loop never pays for them), a
failure is a message in a shared control block (:class:`ServerError` on
the driver side), and the clients learn of the server's death from the transport's liveness pipe,
which closes when the server ends however it ends. Only what cannot be shared differs: a process ties
its life to the driver and sets its own torch threads, seed and (deterministic) algorithms.

A server can also be alive and frozen (a process the kernel stopped, a forward pass that never
returns): the serve loop beats a progress clock in the control block on every turn, and
:meth:`InferenceServer.silent_for` tells the driver's watchdog how long it has been quiet.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from components.inference.loop import SERVER_ACTIVITIES, SERVER_STARTING, ServeLoop, ServerConfig, ServerPulse
from components.inference.slots import SlotTransport
from components.inference.stats import STAT_KEYS, ServerStats
from components.inference.weights import shared_weights, state_of
from components.kinds import WorkerKind
from components.lifecycle import become_child, force_stop, on_main_thread, set_affinity, start_immune
from components.threads import child_pools, pin_pools, report_pools
from components.models import ModelSpec
from components.procname import set_name
from components.shm import FieldSpec, SharedArena

PLACEMENTS = WorkerKind.words()  # where a server runs (server=inline is none: a policy copy per worker)
_STARTING, _READY, _FAILED, _STOPPED = 0, 1, 2, 3
_ERROR_BYTES = 4096
#: Interval counters: what an already-read final snapshot resets to zero.
_INTERVAL_COUNTERS = ("requests", "batches", "rows", "weight_updates")


class ServerError(RuntimeError):
    """The inference server failed to start or died; the message says why."""


def _control_block() -> SharedArena:
    return SharedArena([
        FieldSpec("status", (1,), "int8"),
        FieldSpec("version", (1,), "int64"),
        FieldSpec("error", (_ERROR_BYTES,), "uint8"),
        # the serve loop's pulse (see ServerPulse): time of its last turn, turns, what it is doing
        FieldSpec("progress", (1,), "float64"),
        FieldSpec("beats", (1,), "int64"),
        FieldSpec("activity", (1,), "int8"),
    ])


def _write_error(control: SharedArena, message: str) -> None:
    data = message.encode("utf-8", "replace")[: _ERROR_BYTES - 1]
    control.array("error")[:] = 0
    control.array("error")[: len(data)] = np.frombuffer(data, np.uint8)
    control.array("status")[0] = _FAILED


def _read_error(control: SharedArena) -> str:
    return bytes(control.array("error")).split(b"\0", 1)[0].decode("utf-8", "replace")


def _serve_commands(conn: Any, stats: ServerStats, stop: threading.Event) -> None:
    """Answer ``(seq, command, argument)`` requests until stopped or the driver is gone."""
    while not stop.is_set():
        try:
            if not conn.poll(0.1):
                continue
            seq, command, argument = conn.recv()
            if command == "stats":
                conn.send((seq, stats.read(reset=bool(argument))))
            elif command == "stop":
                stop.set()
        except (EOFError, OSError):  # the driver is gone
            stop.set()
            return


def _server_main(
    model: Any,
    env_spec: Any,
    transport: SlotTransport,
    config: ServerConfig,
    weights: Any,
    control: SharedArena,
    conn: Any,
    version: int,
    placement: str,
    parent_pid: int,
    from_main_thread: bool,
    affinity: list[int] | None,
) -> None:
    if placement == "process":
        become_child(parent_pid, from_main_thread)
        set_name("infer-server")  # as ps shows it
        pin_pools(int(config.num_threads or 1))
        if config.seed is not None:
            torch.manual_seed(config.seed)
        torch.use_deterministic_algorithms(config.deterministic)  # a thread server shares the driver's
    set_affinity(affinity)  # a thread's own mask on Linux; the whole process's otherwise
    stop = threading.Event()
    commands: threading.Thread | None = None
    try:
        net = model.build(env_spec) if isinstance(model, ModelSpec) else model
        net = net.to(config.device).eval()
        stats = ServerStats(config.stats_reservoir, seed=config.seed or 0, policy_version=version)
        published = control.array("version")
        published[0] = version

        def on_version(v: int) -> None:
            published[0] = v

        pulse = ServerPulse(control.array("progress"), control.array("beats"), control.array("activity"))
        loop = ServeLoop(net, transport, config, stats, weights_source=weights, on_version=on_version,
                         version=version, pulse=pulse, obs_leaves=getattr(env_spec, "obs_leaves", ()))
        loop.poll_weights()  # weights pushed before we started act from the first request
        if placement == "process":
            report_pools("infer-server")
        commands = threading.Thread(target=_serve_commands, args=(conn, stats, stop), name="server-commands",
                                    daemon=True)
        commands.start()
        control.array("status")[0] = _READY
        loop.serve(stop)
        control.array("status")[0] = _STOPPED
    except BaseException as exc:  # noqa: BLE001 - reported to the driver through the control block
        _write_error(control, f"{type(exc).__name__}: {exc}")
        if placement == "process":
            raise SystemExit(1) from None
    finally:
        stop.set()
        if placement == "thread":
            # The clients' liveness pipe closes now, exactly as when a server process exits.
            transport.release_liveness_handle()
            if commands is not None:
                commands.join(1.0)


def _empty_interval(snapshot: dict[str, float]) -> dict[str, float]:
    """A read-out final snapshot: counters of a new, empty interval; totals kept."""
    out = dict(snapshot)
    for key in STAT_KEYS:
        if key in _INTERVAL_COUNTERS:
            out[key] = 0
        elif key.endswith(("_per_s",)):
            out[key] = 0.0
        elif not key.endswith("_total") and key not in ("policy_version", "interval_s"):
            out[key] = math.nan
    return out


class InferenceServer:
    """Serves a policy to a :class:`SlotTransport`'s clients from a thread or a process.

    Args:
        model: a :class:`ModelSpec` (built where the server runs; needs
            ``env_spec``) or a module (pickled to a server process).
        transport: the shared-slot transport the clients hold.
        config: batching, device, engine, statistics.
        env_spec: the env's spec, to build ``model`` from a spec.
        placement: "thread" (a driver thread) or "process" (its own process).
        policy_version: the version label of the initial weights.
        ctx: a ``spawn`` multiprocessing context for a process placement.
        template: a state dict with the weights' shapes (default: built).
        affinity: CPUs for the server thread (thread placement) or process.

    Examples:
        >>> import threading
        >>> from components.envs import EnvSpec
        >>> from components.inference.transport import derive_layout
        >>> spec = EnvSpec((4,), "float32", "discrete", action_n=2)
        >>> model = ModelSpec("components.models.ActorCritic")
        >>> transport = SlotTransport(derive_layout(model.build(spec), spec.observation_field()),
        ...                           num_slots=1, rows_per_slot=3, ctx=threading)
        >>> client = transport.client()
        >>> with InferenceServer(model, transport, env_spec=spec) as server:
        ...     client.request["observation"][:] = 0.0
        ...     client.submit()
        ...     out = client.wait(timeout=10)
        ...     stats = server.stats()
        >>> out["action"].shape, int(out["policy_version"][0]), stats["rows"]
        ((3,), 0, 3)
    """

    def __init__(
        self,
        model: ModelSpec | torch.nn.Module,
        transport: SlotTransport,
        config: ServerConfig | None = None,
        *,
        env_spec: Any = None,
        placement: str = "thread",
        policy_version: int = 0,
        ctx: Any = None,
        template: Mapping[str, torch.Tensor] | None = None,
        affinity: list[int] | None = None,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        if isinstance(model, ModelSpec) and env_spec is None:
            raise ValueError("building the policy from a ModelSpec needs env_spec")
        self.config = config or ServerConfig()
        self.transport = transport
        self.placement = placement
        self._model, self._env_spec = model, env_spec
        self._ctx = ctx or mp.get_context("spawn")
        self._initial_version = int(policy_version)
        if template is None:
            template = (model.build(env_spec) if isinstance(model, ModelSpec) else model).state_dict()
        lock_ctx = self._ctx if placement == "process" else threading
        self._weights = shared_weights(template, self.config.device, lock_ctx)
        self._control = _control_block()
        self._control.array("version")[0] = self._initial_version
        self._conn, self._child_conn = mp.Pipe()
        self._conn_lock = threading.Lock()
        self._request_seq = 0
        self._runner: Any = None
        self._affinity = affinity
        self._last_stats: dict[str, float] | None = None
        self._stopped = False

    @property
    def backend(self) -> str:
        return self.placement

    @property
    def weights_channel(self) -> Any:
        """The shared weights the server reads (its lock is process-shared in a process placement)."""
        return self._weights

    def start(self, timeout: float = 120.0) -> InferenceServer:
        """Start serving; wait until the policy is built and serving (or raise why not)."""
        if self._runner is not None:
            return self
        args = (self._model, self._env_spec, self.transport, self.config, self._weights, self._control,
                self._child_conn, self._initial_version, self.placement, os.getpid(), on_main_thread(),
                self._affinity)
        if self.placement == "process":
            self._runner = self._ctx.Process(target=_server_main, args=args, name="inference-server", daemon=True)
            with child_pools(int(self.config.num_threads or 1)):
                start_immune(self._runner)
            self._child_conn.close()
            # From here on the liveness pipe closes exactly when the server process exits.
            self.transport.release_liveness_handle()
        else:
            self._runner = threading.Thread(target=_server_main, args=args, name="inference-server", daemon=True)
            self._runner.start()
        deadline = time.monotonic() + timeout
        status = self._control.array("status")
        while status[0] == _STARTING and self._runner.is_alive():
            if time.monotonic() > deadline:
                self.shutdown()
                raise ServerError(f"the inference server ({self.placement}) did not start within {timeout:.0f} s")
            time.sleep(0.005)
        if status[0] != _READY:
            self._runner.join(1.0)
            detail = self.error or "it exited"
            self.shutdown()
            raise ServerError(f"the inference server ({self.placement}) failed to start: {detail}")
        return self

    @property
    def pid(self) -> int | None:
        """The server process's pid (None in a thread or before start)."""
        return getattr(self._runner, "pid", None) if self.placement == "process" else None

    @property
    def is_alive(self) -> bool:
        return self._runner is not None and self._runner.is_alive()

    def silent_for(self) -> float | None:
        """Seconds since the serve loop last turned (None unless it is serving: starting, stopped, dead)."""
        if self._stopped or not self.is_alive or self._control.array("status")[0] != _READY:
            return None
        beat = float(self._control.array("progress")[0])
        return max(0.0, time.monotonic() - beat) if beat else None

    @property
    def activity(self) -> str:
        """What the serve loop was doing at its last turn (words of :data:`SERVER_ACTIVITIES`)."""
        code = int(self._control.array("activity")[0])
        return SERVER_ACTIVITIES[code] if 0 <= code < len(SERVER_ACTIVITIES) else SERVER_ACTIVITIES[SERVER_STARTING]

    @property
    def beats(self) -> int:
        """Turns of the serve loop so far."""
        return int(self._control.array("beats")[0])

    def pending_requests(self) -> int:
        """Requests submitted and not answered yet (the server has work)."""
        return self.transport.pending()

    def kill(self) -> None:
        """SIGKILL a server process (a frozen one answers nothing gentler); a thread cannot be killed."""
        if self.placement != "process" or self._runner is None:
            raise RuntimeError("only a server process can be killed")
        force_stop(self._runner, grace=5.0)

    @property
    def error(self) -> str | None:
        """Why the server failed (None while it is fine)."""
        text = _read_error(self._control)
        if text:
            return text
        code = getattr(self._runner, "exitcode", None)
        if code not in (None, 0):
            return f"its process exited with code {code}"
        return None

    @property
    def policy_version(self) -> int:
        """The version the server stamps on its responses now."""
        return int(self._control.array("version")[0])

    @property
    def published_version(self) -> int:
        """The version of the latest weights handed to the server (applied before its next batch)."""
        return self._weights.version if self._weights.seq else self._initial_version

    def update_weights(self, weights: torch.nn.Module | Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Publish weights labelled ``version`` (default: the last one + 1); returns the version."""
        label = self.published_version + 1 if version is None else int(version)
        self._weights.publish(state_of(weights), label)
        return label

    def stats(self, reset: bool = True, timeout: float = 2.0) -> dict[str, float]:
        """Statistics since the last ``reset`` read (see :class:`ServerStats`).

        A request that times out is not answered late into the next one:
        replies carry the request's number, and stale ones are dropped.
        When the server cannot answer (stopped or dead), the final snapshot
        taken at shutdown is returned once, then empty intervals.
        """
        if not self.is_alive or self._stopped:
            if self._last_stats is None:
                return {}
            out = self._last_stats
            if reset:
                self._last_stats = _empty_interval(out)
            return dict(out)
        with self._conn_lock:
            self._request_seq += 1
            seq = self._request_seq
            try:
                self._conn.send((seq, "stats", reset))
                deadline = time.monotonic() + timeout
                while self._conn.poll(max(0.0, deadline - time.monotonic())):
                    got, payload = self._conn.recv()
                    if got == seq:
                        self._last_stats = _empty_interval(payload) if reset else payload
                        return dict(payload)
            except (EOFError, OSError):
                pass
        return dict(self._last_stats or {})

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop serving (politely, then by force for a process); idempotent.

        The final statistics are read first, so the last logged interval
        still describes what was served.
        """
        if self._stopped:
            return
        runner = self._runner
        if runner is None:
            self._stopped = True
            self.transport.release_liveness_handle()
            self._conn.close()
            return
        if runner.is_alive():
            self.stats(reset=False, timeout=1.0)
            with self._conn_lock:
                try:
                    self._conn.send((0, "stop", None))
                except (OSError, BrokenPipeError):
                    pass
            runner.join(timeout)
        self._stopped = True
        if self.placement == "process":
            force_stop(runner)
        self._conn.close()

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
