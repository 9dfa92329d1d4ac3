"""A dedicated inference process serving a :class:`SlotTransport`.

The process rebuilds the policy from a :class:`ModelSpec` (an import path
and arguments; no module is pickled), applies whatever weights the trainer
already published, and only then reports ready and serves. Weights arrive
through :class:`SharedWeights`; statistics travel back on request over a
pipe answered by a small command thread, so the serve loop never pays for
them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from components.envs import EnvSpec
from components.inference.server import ServeLoop, ServerConfig, state_of
from components.inference.slots import SlotTransport
from components.inference.stats import ServerStats
from components.inference.weights import CudaSharedWeights, SharedWeights
from components.lifecycle import become_child, force_stop, on_main_thread
from components.models import ModelSpec
from components.shm import FieldSpec, SharedArena

_STARTING, _READY, _FAILED = 0, 1, 2
_ERROR_BYTES = 4096


class ServerProcessError(RuntimeError):
    """The inference process failed to start or died."""


def _control_block() -> SharedArena:
    return SharedArena([
        FieldSpec("status", (1,), "int8"),
        FieldSpec("version", (1,), "int64"),
        FieldSpec("error", (_ERROR_BYTES,), "uint8"),
    ])


def _write_error(control: SharedArena, message: str) -> None:
    data = message.encode("utf-8", "replace")[: _ERROR_BYTES - 1]
    control.array("error")[:] = 0
    control.array("error")[: len(data)] = np.frombuffer(data, np.uint8)
    control.array("status")[0] = _FAILED


def _read_error(control: SharedArena) -> str:
    return bytes(control.array("error")).split(b"\0", 1)[0].decode("utf-8", "replace")


def _serve_commands(conn: Any, stats: ServerStats, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            if not conn.poll(0.1):
                continue
            command, argument = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            stop.set()
            return
        if command == "stats":
            conn.send(stats.summary(reset=bool(argument)))
        elif command == "stop":
            stop.set()


def _server_main(
    model_spec: ModelSpec,
    env_spec: EnvSpec,
    transport: SlotTransport,
    config: ServerConfig,
    weights: SharedWeights,
    control: SharedArena,
    conn: Any,
    parent_pid: int,
    from_main_thread: bool,
) -> None:
    become_child(parent_pid, from_main_thread)
    try:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        model = model_spec.build(env_spec).to(config.device).eval()
        stats = ServerStats(config.stats_window)
        version = control.array("version")

        def published(v: int) -> None:
            version[0] = v

        loop = ServeLoop(model, transport, config, stats, weights_source=weights, on_version=published)
        loop.poll_weights()  # weights pushed before we started act from the first request
        stop = threading.Event()
        threading.Thread(target=_serve_commands, args=(conn, stats, stop), name="server-commands", daemon=True).start()
        control.array("status")[0] = _READY
        loop.serve(stop)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, then exit non-zero
        _write_error(control, f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None


class ProcessInferenceServer:
    """Driver-side handle of an inference process; same surface as ``InferenceServer``.

    Example::

        transport = SlotTransport(layout, num_slots=4, rows_per_slot=8)
        clients = [transport.client() for _ in range(4)]   # one per worker process
        server = ProcessInferenceServer(model_spec, env_spec, transport).start()
        server.update_weights(trainer.model)                # shared memory, versioned
        server.stats()["avg_batch_size"]
        server.shutdown()
    """

    backend = "process"

    def __init__(
        self,
        model_spec: ModelSpec,
        env_spec: EnvSpec,
        transport: SlotTransport,
        config: ServerConfig | None = None,
        *,
        template: Mapping[str, torch.Tensor] | None = None,
        ctx: Any = None,
    ) -> None:
        self.config = config or ServerConfig()
        self.transport = transport
        self._model_spec, self._env_spec = model_spec, env_spec
        self._ctx = ctx or mp.get_context("spawn")
        if template is None:
            template = model_spec.build(env_spec).state_dict()
        if torch.device(self.config.device).type == "cuda":
            self._weights: Any = CudaSharedWeights(template, self.config.device, self._ctx)
        else:
            self._weights = SharedWeights(template, self._ctx)
        self._control = _control_block()
        self._conn, self._child_conn = self._ctx.Pipe()
        self._conn_lock = threading.Lock()
        self._process: Any = None
        self._last_stats: dict[str, float] = {}

    def start(self, timeout: float = 120.0) -> ProcessInferenceServer:
        """Spawn the process and wait until it serves (or raise why it cannot)."""
        if self._process is not None:
            return self
        self._process = self._ctx.Process(
            target=_server_main,
            args=(self._model_spec, self._env_spec, self.transport, self.config, self._weights,
                  self._control, self._child_conn, os.getpid(), on_main_thread()),
            name="inference-server",
            daemon=True,
        )
        self._process.start()
        self._child_conn.close()
        # From here on the liveness pipe closes exactly when the server exits.
        self.transport.release_liveness_handle()
        deadline = time.monotonic() + timeout
        status = self._control.array("status")
        while status[0] == _STARTING:
            if not self._process.is_alive():
                break
            if time.monotonic() > deadline:
                self.shutdown()
                raise ServerProcessError(f"the inference process did not start within {timeout:.0f} s")
            time.sleep(0.005)
        if status[0] != _READY:
            self._process.join(1.0)
            raise ServerProcessError(f"the inference process failed to start: {self.error or 'it exited'}")
        return self

    @property
    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def error(self) -> str | None:
        text = _read_error(self._control)
        if text:
            return text
        if self._process is not None and self._process.exitcode not in (None, 0):
            return f"exit code {self._process.exitcode}"
        return None

    @property
    def policy_version(self) -> int:
        return int(self._control.array("version")[0])

    @property
    def published_version(self) -> int:
        return self._weights.version

    def update_weights(self, weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> int:
        """Publish new weights; the server applies them before its next batch."""
        return self._weights.publish(state_of(weights))

    def stats(self, reset: bool = False, timeout: float = 2.0) -> dict[str, float]:
        """The server's statistics (the last known ones if it cannot answer)."""
        if not self.is_alive:
            return dict(self._last_stats)
        with self._conn_lock:
            try:
                self._conn.send(("stats", reset))
                if self._conn.poll(timeout):
                    self._last_stats = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                pass
        return dict(self._last_stats)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the process (politely, then by force); idempotent."""
        if self._process is None:
            self.transport.release_liveness_handle()
            return
        if self._process.is_alive():
            self.stats(timeout=1.0)  # keep the final statistics readable after the stop
        process, self._process = self._process, None
        if process.is_alive():
            with self._conn_lock:
                try:
                    self._conn.send(("stop", None))
                except (OSError, BrokenPipeError):
                    pass
            process.join(timeout)
        force_stop(process)
        self._conn.close()
