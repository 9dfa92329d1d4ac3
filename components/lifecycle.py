"""Child-process hygiene: die with the parent, leave Ctrl-C to the parent.

Every process this project spawns calls :func:`become_child` first. Two
independent mechanisms make it exit when the driver dies, however the driver
dies (exception, Ctrl-C, SIGTERM, SIGKILL):

* ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux: immediate, kernel-enforced,
  but tied to the *thread* that spawned us, so it is only armed when the
  spawner was the parent's main thread;
* a daemon thread that notices re-parenting (``os.getppid()`` changes)
  within :data:`PARENT_POLL_S` and calls ``os._exit``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PARENT_POLL_S = 0.25
_PR_SET_PDEATHSIG = 1


def _arm_pdeathsig() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(70)
        time.sleep(PARENT_POLL_S)


def become_child(parent_pid: int, spawned_from_main_thread: bool = True) -> None:
    """Tie this process's life to ``parent_pid`` and ignore terminal signals.

    SIGINT from a terminal reaches the whole foreground process group; the
    driver owns the orderly shutdown, so children ignore it (and SIGTERM
    sent to the group) and stop when the driver tells them or dies. They
    are started with both ignored already (:func:`start_immune`); this
    keeps it so.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if spawned_from_main_thread:
        _arm_pdeathsig()
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(70)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def start_immune(process: object) -> None:
    """Start ``process`` with SIGINT and SIGTERM ignored from its first instruction.

    An ignored disposition survives ``exec``, and Python installs its
    KeyboardInterrupt handler only where SIGINT is not ignored, so a Ctrl-C
    that reaches the process group while the child is still importing
    cannot kill it with a traceback. The parent ignores the two signals only
    for the moment of the fork (a signal in those microseconds is lost: press
    again).
    """
    if not on_main_thread():  # signal dispositions can only be changed there
        process.start()  # type: ignore[attr-defined]
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        process.start()  # type: ignore[attr-defined]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def set_affinity(cpus: list[int] | None) -> None:
    """Pin this process to ``cpus`` where the OS supports it (Linux)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def limit_threads() -> None:
    """One intra-op thread per worker: many processes share few cores."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def force_stop(process: object, grace: float = 1.0) -> None:
    """SIGKILL a child that did not stop when asked (children ignore SIGTERM, see :func:`become_child`)."""
    if process.is_alive():  # type: ignore[attr-defined]
        process.kill()  # type: ignore[attr-defined]
        process.join(grace)  # type: ignore[attr-defined]
