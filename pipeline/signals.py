"""Ctrl-C and SIGTERM during start-up: remembered, not only raised.

A signal handler can only raise an exception at the next bytecode the main
thread runs; if that bytecode sits inside a library's bare ``except:`` (a
few optional-import probes have one), the ``KeyboardInterrupt`` is swallowed
and the run would go on as if nothing happened. So the handler also writes
the signal down, and the runner checks the note between start-up phases.
"""

from __future__ import annotations

import signal
from typing import Any

_PENDING: list[str] = []


def _note_and_raise(signum: int, _frame: Any) -> None:
    name = signal.Signals(signum).name
    _PENDING.append(name)
    raise KeyboardInterrupt(name)


def catch_early() -> None:
    """From here on SIGINT and SIGTERM raise ``KeyboardInterrupt`` and are remembered."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _note_and_raise)


def raise_if_pending() -> None:
    """Raise ``KeyboardInterrupt`` if a signal arrived whose exception someone swallowed."""
    if _PENDING:
        raise KeyboardInterrupt(_PENDING[0])
