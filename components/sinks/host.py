"""The optional sinks (TensorBoard, wandb, ``logger.extra_sinks``) in a process of their own.

Measured on the default CartPole run (2 CPUs): with wandb and TensorBoard
in the driver the training loop took 8.6 s, with ``metrics.jsonl`` alone
6.9 s. Neither writes much; their Python does: wandb's start (~2 s of
imports and settings validation), its SDK threads and the TensorBoard
writer all take the driver's GIL from the trainer and the thread workers.
In a child process they run beside the run instead of inside it.

A sink may also stop answering (a wandb service that hangs, a network file
system under ``tb/`` that blocks every write), and nothing it does may stop
training or the end of the run. So rows travel through a bounded queue and
the driver never waits for the child: ``put_nowait`` only takes a slot of
the queue's semaphore and hands the row to the queue's feeder thread, which
does the pickling and the pipe write (it may block on a full pipe; the
driver does not). When the child is ``queue_rows`` rows behind, rows are
dropped for the sinks (``metrics.jsonl``, written in the driver, still gets
every one), counted in :attr:`SinkHost.dropped` and said once. At the end
the summary and the close get the time the caller allows, in total; a
child that has not closed by then is killed (one line) and the run ends
without it.

What the child has to say comes back over a pipe of its own, read at the
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
import multiprocessing.queues
import os
import queue
import sys
import time
from collections.abc import Sequence
from typing import Any

#: (sink name, "module.Class", positional args, keyword args): how the child builds a sink
SinkSpec = tuple[str, str, tuple[Any, ...], dict[str, Any]]
#: attributes a sink reports back once it is open (read by the run later)
_ATTRS = ("id", "dir", "log_dir")
#: rows the child may be behind before rows are dropped (``logger.queue_rows``)
QUEUE_ROWS = 256
#: seconds a close waits quietly before it says what it waits for
QUIET_S = 2.0


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


class _RowQueue(multiprocessing.queues.Queue):
    """The bounded queue of rows; its feeder thread never holds up the driver's exit.

    The feeder thread is not joined at exit (it may be stuck writing to a
    child that stopped reading), and once the child is gone :meth:`release`
    closes the driver's read end, so a stuck write fails with EPIPE and the
    thread ends quietly instead of printing a traceback or staying blocked.
    """

    def __init__(self, maxsize: int, ctx: Any) -> None:
        super().__init__(maxsize, ctx=ctx)
        self.maxsize = maxsize
        self._ignore_epipe = True
        self.cancel_join_thread()

    def release(self) -> None:
        """Once the child is gone: end the feeder thread, whatever it was doing.

        The read end is closed first (a write stuck on the full pipe fails
        with EPIPE: the thread ends quietly), then the sentinel is queued (an
        idle thread wakes, finds the read end already closed and closes the
        write end). Never the other way round: after the sentinel the thread
        closes the read end itself, and two threads closing one descriptor
        could close someone else's.
        """
        self._reader.close()
        self.close()


def _host_main(rows: Any, conn: Any, specs: Sequence[SinkSpec], parent_pid: int, from_main_thread: bool) -> None:
    from components.lifecycle import become_child
    from components.threads import pin_pools, report_pools

    become_child(parent_pid, from_main_thread)
    pin_pools(1)  # writes files: a pool per CPU would only compete with the workers
    conn.send(("ready",))  # the queue's semaphores are open here: the driver may unlink their names
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
    report_pools("metric-sinks")
    exit_code = 1
    while True:
        try:
            message = rows.get()
        except (EOFError, OSError):  # the queue is gone: close what we have
            break
        if message[0] == "close":
            exit_code = int(message[1])
            break
        for name, sink in list(sinks.items()):
            method = getattr(sink, message[0], None)
            if method is None and message[0] == "video":  # an optional call: a sink that shows no videos skips it
                continue
            try:
                method(*message[1:])  # a missing required method (log, summary) fails that sink below
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
    """The driver's end: ``send``/``summary``/``close`` go to every sink the child still has.

    ``send`` and ``summary`` never wait for the child; ``close`` and
    ``attr`` wait at most the time they are given.
    """

    def __init__(self, specs: Sequence[SinkSpec], queue_rows: int = QUEUE_ROWS) -> None:
        from components.lifecycle import on_main_thread, start_immune
        from components.threads import child_pools

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=False)  # the child's messages to the driver
        self._rows = _RowQueue(max(1, int(queue_rows)), ctx)
        self.names = [spec[0] for spec in specs]  # live sinks, in order
        self.attrs: dict[str, dict[str, str]] = {}
        #: rows the sinks did not get because the child was ``queue_rows`` behind
        self.dropped = 0
        self._summary: tuple[Any, ...] | None = None  # a summary the full queue did not take yet
        self._gave_up: set[str] = set()  # sinks whose attributes were waited for in vain once
        self._closed = False
        self._process = ctx.Process(target=_host_main,
                                    args=(self._rows, child, list(specs), os.getpid(), on_main_thread()),
                                    name="metric-sinks", daemon=True)
        with child_pools(1):
            start_immune(self._process)
        child.close()  # a host never closed is killed at exit (start_immune's backstop), not waited for

    def _warn(self, name: str, what: str, detail: str) -> None:
        if name in self.names:
            self.names.remove(name)
            print(f"warning: logger sink {name} {what} ({detail}); the run goes on without it", file=sys.stderr,
                  flush=True)

    def _lost(self, why: str) -> None:
        for name in list(self.names):
            self._warn(name, "failed", why)

    def _exited(self) -> str:
        return f"its process exited with code {self._process.exitcode}"

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
                    self._lost(self._exited())
                    return
                if wait_for is None or left <= 0:
                    return
                continue
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._lost(self._exited())
                return
            if message[0] == "warn":
                self._warn(*message[1:])
            elif message[0] == "open":
                self.attrs[message[1]] = message[2]
            elif message[0] == "ready":
                from components.lifecycle import release_semaphore_names

                release_semaphore_names(self._rows)  # opened by the child: nothing left in /dev/shm after a kill
            elif message[0] == "closed":
                self._closed = True

    def send(self, *message: Any) -> None:
        """Queue one message (a row) for the sinks; dropped, never waited for, when the child is behind."""
        self._drain()
        if not self.names:
            return
        try:
            self._rows.put_nowait(message)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                print(f"warning: logger sinks {', '.join(self.names)} are {self._rows.maxsize} rows behind "
                      "(a sink is slow or stuck); rows are dropped for them until they catch up, counted in "
                      "logger/dropped_rows (metrics.jsonl keeps every row)", file=sys.stderr, flush=True)

    def summary(self, values: dict[str, Any]) -> None:
        """Queue the final values; kept for :meth:`close` (not dropped) when the queue is full."""
        self._drain()
        if not self.names:
            return
        try:
            self._rows.put_nowait(("summary", values))
        except queue.Full:
            self._summary = ("summary", values)

    def attr(self, name: str, key: str, timeout: float) -> str | None:
        """An attribute sink ``name`` reported when it opened (waits for the open, at most ``timeout``, once)."""
        wait = 0.0 if name in self._gave_up else timeout
        self._drain(lambda: name in self.attrs or name not in self.names, wait)
        if name not in self.attrs and name in self.names:
            self._gave_up.add(name)  # a stuck start must not cost every later checkpoint the wait again
        return self.attrs.get(name, {}).get(key)

    def close(self, exit_code: int, timeout: float) -> None:
        """The summary, then close every sink (wandb's finish too) within ``timeout`` in all; then the process.

        A child that has not closed by then is killed: one line, and the run
        ends without it. A close that takes more than a moment says what it
        waits for, once. An exception here (a second Ctrl-C) kills it too.
        """
        deadline = time.monotonic() + timeout
        said = False

        def patiently(attempt: Any) -> bool:
            """``attempt(seconds)`` quietly for a moment, then, saying so, for the time left."""
            nonlocal said
            if attempt(min(QUIET_S, max(0.0, deadline - time.monotonic()))):
                return True
            self._drain()  # a child that died meanwhile: said, and nothing more to wait for
            left = deadline - time.monotonic()
            if left <= 0 or not self.names:
                return False
            if not said and left >= 1:
                said = True
                print(f"waiting up to {left:.0f} s for the logger sink(s) {', '.join(self.names)} to finish "
                      "(Ctrl-C abandons them)", file=sys.stderr, flush=True)
            return attempt(left)

        def put(message: tuple[Any, ...]) -> Any:
            def attempt(seconds: float) -> bool:
                try:
                    self._rows.put(message, timeout=seconds)
                except queue.Full:
                    return False
                return True
            return attempt

        def closed(seconds: float) -> bool:
            self._drain(lambda: self._closed, seconds)
            return self._closed or not self.names

        try:
            self._drain()
            if self.names:
                messages = ([self._summary] if self._summary else []) + [("close", int(exit_code))]
                if all(patiently(put(message)) for message in messages):
                    patiently(closed)
                if not self._closed and self.names:
                    self._process.kill()
                    self._lost(f"it did not answer within {timeout:g} s; its process was killed")
            else:
                try:
                    self._rows.put_nowait(("close", int(exit_code)))
                except queue.Full:
                    pass
        finally:
            if self._process.is_alive():
                self._process.join(2.0 if self._closed else 0.0)
            if self._process.is_alive():
                self._process.kill()
            self._process.join(2.0)
            self._rows.release()
            self._conn.close()
