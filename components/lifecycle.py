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

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

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


#: children started by :func:`start_immune` (weakly: a retired worker's process object may go)
_IMMUNE: weakref.WeakSet[Any] = weakref.WeakSet()
_backstop_armed = False


def _kill_immune_children() -> None:
    """At interpreter exit, SIGKILL the immune children nobody stopped.

    ``multiprocessing``'s exit hook SIGTERMs daemonic children and then
    joins them without a timeout; ours ignore SIGTERM, so a script that
    ends (or raises) without shutting its collector or server down would
    hang there for good. This finaliser runs before that hook (exit
    priority 0 runs ahead of the joins); the owners' own at-exit clean-ups
    (a collector's shutdown, priority 10) run before it.
    """
    for process in list(_IMMUNE):
        force_stop(process, grace=2.0)


def _shutdown(ref: weakref.ref[Any]) -> None:
    owner = ref()
    if owner is not None:
        owner.shutdown()


def shutdown_at_exit(owner: object) -> Any:
    """Call ``owner.shutdown()`` at interpreter exit unless cancelled (``.cancel()`` on the returned handle).

    For what owns immune children (a collector): a script that ends or
    raises without shutting it down stops it in order (shared memory
    released) ahead of :func:`_kill_immune_children` and of multiprocessing's
    exit hook, which would otherwise wait for ever on children that ignore
    SIGTERM. Holds ``owner`` weakly.
    """
    import multiprocessing.util

    return multiprocessing.util.Finalize(None, _shutdown, args=(weakref.ref(owner),), exitpriority=10)


def start_immune(process: object) -> None:
    """Start ``process`` with SIGINT and SIGTERM ignored from its first instruction.

    An ignored disposition survives ``exec``, and Python installs its
    KeyboardInterrupt handler only where SIGINT is not ignored, so a Ctrl-C
    that reaches the process group while the child is still importing
    cannot kill it with a traceback. The parent ignores the two signals only
    for the moment of the fork (a signal in those microseconds is lost: press
    again). Since such a child cannot be SIGTERMed, it is killed at the
    parent's exit if still alive (:func:`_kill_immune_children`).
    """
    global _backstop_armed
    if not _backstop_armed:
        import multiprocessing.util

        multiprocessing.util.Finalize(None, _kill_immune_children, exitpriority=0)
        _backstop_armed = True
    with children_ignore_signals():
        process.start()  # type: ignore[attr-defined]
    _IMMUNE.add(process)


@contextlib.contextmanager
def children_ignore_signals() -> Iterator[None]:
    """Children started inside (``multiprocessing`` or ``subprocess``) ignore SIGINT and SIGTERM from birth.

    For helpers that a Ctrl-C to the process group must not kill with a
    traceback (the layout probes' bare interpreters as much as the
    collector's workers): they end when their parent closes their pipes or
    tells them to. Off the main thread (where dispositions cannot change)
    this does nothing.
    """
    if not on_main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


SEMAPHORE_PREFIX = "rlp"


def name_semaphores_by_pid() -> None:
    """Name this process's future semaphores ``/dev/shm/sem.rlp-<pid>-*`` (instead of ``mp-*``).

    With the owner's pid in the name, leftovers of a run killed before it
    could release them (:func:`release_semaphore_names`) can be told from a
    live run's and swept (:func:`sweep_stale_semaphores`).
    """
    import multiprocessing

    config = getattr(multiprocessing.current_process(), "_config", None)
    if isinstance(config, dict):
        config["semprefix"] = f"/{SEMAPHORE_PREFIX}-{os.getpid()}"


def sweep_stale_semaphores(directory: str = "/dev/shm") -> int:
    """Remove ``sem.rlp-<pid>-*`` entries whose process is gone; returns how many."""
    removed = 0
    try:
        entries = os.listdir(directory)
    except OSError:
        return 0
    for entry in entries:
        parts = entry.split("-")
        if not entry.startswith(f"sem.{SEMAPHORE_PREFIX}-") or len(parts) < 3 or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
            continue  # its run is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, entry))
            removed += 1
        except OSError:
            pass
    return removed


def release_semaphore_names(*owners: object) -> int:
    """Unlink the names of the process-shared semaphores and locks ``owners`` hold.

    A ``spawn`` context's semaphores are POSIX named semaphores
    (``/dev/shm/sem.mp-*``); children open them by name while unpickling
    their arguments, and the names are removed by a tracker process when the
    driver exits normally. A SIGKILL of the whole process group kills the
    tracker too and leaves the names behind, run after run. Once every child
    has opened them, the names are no longer needed: unlinking them then
    keeps the semaphores working (open handles stay valid) and leaves
    nothing in ``/dev/shm`` whatever happens next. Returns how many were
    unlinked; thread-only primitives are skipped.
    """
    from multiprocessing import resource_tracker, synchronize, util

    registry = getattr(util, "_finalizer_registry", None)
    cleanup = getattr(synchronize.SemLock, "_cleanup", None)
    if registry is None or cleanup is None:  # another Python: leave the names to the tracker
        return 0
    names: set[str] = set()

    def collect(value: object) -> None:
        if isinstance(value, synchronize.SemLock):
            name = getattr(value._semlock, "name", None)
            if name:
                names.add(name)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    for owner in owners:
        if owner is None:  # e.g. no transport: the policy runs inline in the workers
            continue
        for value in vars(owner).values():
            collect(value)
    # The creator's exit-time clean-up would unlink the names again and complain.
    for finalizer in list(registry.values()):
        if getattr(finalizer, "_callback", None) is cleanup and getattr(finalizer, "_args", ())[:1] \
                and finalizer._args[0] in names:
            finalizer.cancel()
    unlinked = 0
    for name in names:
        try:
            synchronize.sem_unlink(name)
            unlinked += 1
        except FileNotFoundError:
            pass
        try:
            resource_tracker.unregister(name, "semaphore")
        except Exception:  # noqa: BLE001 - a tracker that is gone has nothing to forget
            pass
    return unlinked


def on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def set_affinity(cpus: list[int] | None) -> None:
    """Pin this process to ``cpus`` where the OS supports it (Linux)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def force_stop(process: object, grace: float = 1.0) -> None:
    """SIGKILL a child that did not stop when asked (children ignore SIGTERM, see :func:`become_child`)."""
    if process.is_alive():  # type: ignore[attr-defined]
        process.kill()  # type: ignore[attr-defined]
        process.join(grace)  # type: ignore[attr-defined]


def take_shared_lock(lock: object, abandoned_after_s: float) -> None:
    """Acquire a lock shared with other processes; take it over from one that died holding it.

    The hot-path locks shared with workers are held for a few stores, so
    one still held after ``abandoned_after_s`` belongs to a process that was
    SIGKILLed inside it (a hung worker is replaced that way, a chaos test
    does it at random). A ``multiprocessing`` lock has no owner to check;
    waiting on would hang for good, so release it as its dead owner would
    have and contend again.
    """
    while not lock.acquire(True, abandoned_after_s):  # type: ignore[attr-defined]  # positional: mp and threading spell it differently
        try:
            lock.release()  # type: ignore[attr-defined]
        except (ValueError, RuntimeError):  # released meanwhile after all (mp, threading)
            pass


def spawn_from_any_process() -> None:
    """Make ``spawn`` children work from a process that another library started (a joblib job).

    A spawned child re-applies its parent's global start method; in a
    joblib (loky) worker that is ``loky``, which a plain child cannot find,
    so every worker and server process would die at birth. The collector
    asks for a ``spawn`` context explicitly anyway.
    """
    import multiprocessing

    if multiprocessing.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        multiprocessing.set_start_method("spawn", force=True)
