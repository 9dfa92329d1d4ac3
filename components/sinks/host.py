"""The optional sinks (TensorBoard, wandb) in a process of their own.

Measured on the default CartPole run (2 CPUs): with wandb and TensorBoard
in the driver the training loop took 8.6 s, with ``metrics.jsonl`` alone
6.9 s. Neither writes much; their Python does: wandb's start (~2 s of
imports and settings validation), its SDK threads and the TensorBoard
writer all take the driver's GIL from the trainer and the thread workers.
In a child process they run beside the run instead of inside it.

The driver sends each row once over a pipe; the child fans it out to its
sinks. What the child has to say comes back as messages read at the
driver's next call: a sink that could not start or failed is one warning
line and is dropped (the others go on), a sink that opened reports the
attributes the run needs later (the wandb run id for resume). The child
ignores Ctrl-C (the driver closes it in order) and dies with the driver;
if it dies first, that is one warning and the run goes on with
``metrics.jsonl``.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

#: (sink name, "module.Class", positional args, keyword args): how the child builds a sink
SinkSpec = tuple[str, str, tuple[Any, ...], dict[str, Any]]
#: attributes a sink reports back once it is open (read by the run later)
_ATTRS = ("id", "dir", "log_dir")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _host_main(conn: Any, specs: Sequence[SinkSpec], parent_pid: int, from_main_thread: bool) -> None:
    from components.lifecycle import become_child

    become_child(parent_pid, from_main_thread)
    sinks: dict[str, Any] = {}
    for name, target, args, kwargs in specs:
        module, _, attr = target.rpartition(".")
        try:
            sinks[name] = getattr(importlib.import_module(module), attr)(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - an optional view: the driver warns and goes on
            conn.send(("warn", name, "could not start", _first_line(err)))
            continue
        attrs = {}
        for key in _ATTRS:
            try:
                value = getattr(sinks[name], key)
            except Exception:  # noqa: BLE001 - a sink without it
                continue
            attrs[key] = str(value)
        conn.send(("open", name, attrs))
    exit_code = 1
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the driver is gone: close what we have
            break
        if message[0] == "close":
            exit_code = int(message[1])
            break
        for name, sink in list(sinks.items()):
            try:
                getattr(sink, message[0])(*message[1:])
            except Exception as err:  # noqa: BLE001 - see the module docstring
                del sinks[name]
                conn.send(("warn", name, "failed", _first_line(err)))
    for name, sink in sinks.items():
        try:
            sink.close(exit_code)
        except Exception as err:  # noqa: BLE001
            conn.send(("warn", name, "failed", _first_line(err)))
    try:
        conn.send(("closed",))
    except (BrokenPipeError, OSError):
        pass


class SinkHost:
    """The driver's end: ``log``/``summary``/``close`` go to every sink the child still has."""

    def __init__(self, specs: Sequence[SinkSpec]) -> None:
        from components.lifecycle import on_main_thread, start_immune

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.names = [spec[0] for spec in specs]  # live sinks, in order
        self.attrs: dict[str, dict[str, str]] = {}
        self._closed = False
        self._process = ctx.Process(target=_host_main, args=(child, list(specs), os.getpid(), on_main_thread()),
                                    name="metric-sinks", daemon=True)
        start_immune(self._process)
        child.close()

    def _warn(self, name: str, what: str, detail: str) -> None:
        if name in self.names:
            self.names.remove(name)
            print(f"warning: logger sink {name} {what} ({detail}); the run goes on without it", file=sys.stderr,
                  flush=True)

    def _lost(self, why: str) -> None:
        for name in list(self.names):
            self._warn(name, "failed", why)

    def _drain(self, wait_for: Any = None, timeout: float = 0.0) -> None:
        """Read the child's messages; with ``wait_for`` (a predicate), until it holds or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if wait_for is not None and wait_for():
                return
            left = deadline - time.monotonic()
            try:
                ready = self._conn.poll(max(0.0, left) if wait_for is not None else 0)
            except (OSError, EOFError):
                ready = False
            if not ready:
                if wait_for is not None and left > 0 and not self._process.is_alive():
                    self._lost(f"its process exited with code {self._process.exitcode}")
                    return
                if wait_for is None or left <= 0:
                    return
                continue
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._lost(f"its process exited with code {self._process.exitcode}")
                return
            if message[0] == "warn":
                self._warn(*message[1:])
            elif message[0] == "open":
                self.attrs[message[1]] = message[2]
            elif message[0] == "closed":
                self._closed = True

    def send(self, *message: Any) -> None:
        self._drain()
        if not self.names:
            return
        try:
            self._conn.send(message)
        except (BrokenPipeError, OSError):
            self._lost(f"its process exited with code {self._process.exitcode}")

    def attr(self, name: str, key: str, timeout: float) -> str | None:
        """An attribute sink ``name`` reported when it opened (waits for the open, at most ``timeout``)."""
        self._drain(lambda: name in self.attrs or name not in self.names, timeout)
        return self.attrs.get(name, {}).get(key)

    def close(self, exit_code: int, timeout: float) -> None:
        """Close every sink (each may take up to ``timeout``: wandb's finish), then the process."""
        if self.names:
            self.send("close", exit_code)
            self._drain(lambda: self._closed, timeout)
            if not self._closed:
                self._lost(f"it did not close within {timeout:g} s")
        else:
            try:
                self._conn.send(("close", exit_code))
            except (BrokenPipeError, OSError):
                pass
        self._process.join(2.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(2.0)
        self._conn.close()
