"""Ctrl-C and SIGTERM during start-up: remembered, not only raised.

A signal handler can only raise an exception at the next bytecode the main
thread runs; if that bytecode sits inside a library's bare ``except:`` (a
few optional-import probes have one), the ``KeyboardInterrupt`` is swallowed
and the run would go on as if nothing happened. So the handler also writes
the signal down, and the runner acts on the note between start-up phases.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any, NoReturn

_PENDING: list[str] = []


def _note_and_raise(signum: int, _frame: Any) -> None:
    name = signal.Signals(signum).name
    _PENDING.append(name)
    if len(_PENDING) > 1:  # a second signal: do not wait for the next check
        raise KeyboardInterrupt(name)


def catch_early() -> None:
    """From here on SIGINT and SIGTERM are remembered; the runner acts on the first one at its next check.

    Raising from the handler at once could land inside a library's
    half-done state change (OmegaConf's flag handling while Hydra composes
    the config), which then fails with an unrelated error and a traceback.
    The runner checks (:func:`raise_if_pending`) as soon as it starts and
    between its start-up phases; a second signal raises at once.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _note_and_raise)


class Interrupted(BaseException):
    """SIGTERM/SIGINT arrived once the run had started; it stops cleanly.

    A ``BaseException``, like ``KeyboardInterrupt``: code that catches
    ``Exception`` (Hydra's ``instantiate`` wraps those) must not swallow it.
    """


def _note_and_interrupt(signum: int, _frame: Any) -> None:
    name = signal.Signals(signum).name
    _PENDING.append(name)
    raise Interrupted(name)


def catch_signals() -> dict[int, Any]:
    """From here on SIGINT and SIGTERM are noted and raise :class:`Interrupted`; returns the previous handlers.

    The runner's handler, once start-up is past the parts a raise could
    corrupt (see :func:`catch_early`).
    """
    return {sig: signal.signal(sig, _note_and_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}


def ignore_signals(signals: dict[int, Any]) -> None:
    """From here on ``signals`` (SIGINT, SIGTERM) are ignored: what follows must not be cut short."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def signals_raise(signals: dict[int, Any]) -> Iterator[None]:
    """For one step of the clean-up that may be abandoned (the sinks' close), ``signals`` raise again."""
    for sig in signals:
        signal.signal(sig, _note_and_interrupt)
    try:
        yield
    finally:
        for _ in range(3):  # a signal landing while they are ignored again: the step is over anyway
            try:
                ignore_signals(signals)
                break
            except (KeyboardInterrupt, Interrupted):
                continue


def wrapped_interrupt(err: BaseException) -> BaseException | None:
    """The Ctrl-C or SIGTERM behind ``err``, when a C extension turned it into another exception.

    A signal handler's exception raised while a Cython call runs (Ray's
    ``CoreWorker.wait``) comes back as ``SystemError: ... returned a result
    with an exception set``, the interrupt only in its context. Such a run
    was interrupted, not failed: it must end as one (exit 130, checkpoint,
    summary) instead of with a traceback.
    """
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (KeyboardInterrupt, Interrupted)):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if isinstance(err, SystemError) and _PENDING:  # the context was dropped, the signal's note was not
        return Interrupted(_PENDING[0])
    return None


def interrupt_of(err: BaseException) -> BaseException:
    """The interrupt ``err`` is or wraps (see :func:`wrapped_interrupt`); ``err`` raised again when it is none."""
    found = wrapped_interrupt(err)
    if found is None:
        raise err
    return found


def raise_if_pending() -> None:
    """Raise ``KeyboardInterrupt`` if a signal arrived whose exception someone swallowed."""
    if _PENDING:
        raise KeyboardInterrupt(_PENDING[0])


def exit_interrupted(code: int = 130) -> NoReturn:
    """Leave with ``code`` after an interrupt, whatever saw the ``KeyboardInterrupt`` first.

    CPython marks a ``KeyboardInterrupt`` as unhandled for good when it
    surfaces inside code that a C extension evaluates (pybind11's
    ``py::exec`` while ``import torch`` runs), even if Python code catches it
    later; at exit the interpreter then kills itself with SIGINT (status -2)
    instead of returning 130. So the process leaves through :func:`leave`.
    """
    leave(code, wait_for_threads=False)


class _StdoutOrNothing:
    """``sys.stdout`` that goes quiet, instead of raising, once its reader is gone (``... | head``).

    A training run must not die halfway because a pager stopped reading its
    progress lines: its checkpoint, metrics and run directory are what
    matter. On the first ``BrokenPipeError`` the stdout descriptor is
    pointed at ``/dev/null`` (so what is still buffered, and whatever child
    processes print, drains there) and the run goes on.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._silence()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._silence()

    def _silence(self) -> None:
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        try:
            self._stream.flush()  # what was buffered for the closed pipe
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def survive_closed_stdout() -> None:
    """From here on a closed stdout (its reader exited) silences the run's output instead of ending the run."""
    import sys

    if not isinstance(sys.stdout, _StdoutOrNothing) and sys.stdout is not None:
        sys.stdout = _StdoutOrNothing(sys.stdout)


def leave(code: int, wait_for_threads: bool = True) -> NoReturn:
    """Run the exit handlers and leave with ``code``, without the interpreter's teardown.

    By the time a run returns, every file is closed, every child joined and
    every sink flushed; what the interpreter still does is tear down torch,
    sympy (which ``torch.optim`` imports through ``torch._dynamo``) and the
    rest module by module: 0.5-0.9 s of a CartPole run's ~10 s, for nothing.
    The exit handlers (multiprocessing's clean-up, logging's flush) still run
    here. With a non-daemon thread still running the interpreter would wait
    for it, so then this exits the normal way.
    """
    import atexit
    import os
    import sys
    import threading

    if wait_for_threads and any(t is not threading.main_thread() and not t.daemon and t.is_alive()
                                for t in threading.enumerate()):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
            pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):  # what the exit handlers printed
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
