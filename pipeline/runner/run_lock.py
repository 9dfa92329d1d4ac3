"""Claiming a run directory: one run per directory, decided by one kernel operation.

Two runs started in the same second must never write into one directory,
and a refused run must not touch the directory it was refused.

Why an ``flock`` held for the run's whole life (and not an exclusive create
of a pid file): whether a lock file's owner still runs cannot be decided
from its content. A pid may be reused, may be 0 or garbage, may come from
another machine, and replacing a stale file (check, unlink, create) is
three steps another claimant can interleave with: two processes both won
106 of 200 races that way. ``flock(LOCK_EX | LOCK_NB)`` on ``.run.lock``
is one kernel operation that exactly one open file can win, and the
kernel drops it when its holder dies, SIGKILL included: a stale lock is
simply one nobody holds, taken over by the same single operation. The
descriptor is ``O_CLOEXEC`` and closed in forked children
(``os.register_at_fork``), so workers, sinks and Ray processes never keep
a directory claimed after the driver is gone. The file's content (pid,
host, start and end time) is only what messages quote.

A claimant that won the lock checks that the path still names the file it
locked (a refused claimant removes a lock file it created itself; the next
claimant then locks a fresh one), so a removed file never hands out a
second claim.

Why ``rundir.take_over``: ``flock`` may not reach across machines (some
network file systems keep it per host). A lock file naming another host
whose run did not record a clean end (``ended``) may belong to a run that
is still alive there, so it is refused with the exact command that takes
it over once the user knows that run is gone.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import secrets
import shlex
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.atomic_files import create_exclusive
from pipeline.plan.validate import ConfigError

LOCK = ".run.lock"
#: Files that mark a directory as holding a run (also without a lock: older runs).
RUN_FILES = ("checkpoint.pt", "metrics.jsonl")
#: Version of the lock content; a lock without it was written by a run before flock (pid-file claims).
LOCK_VERSION = 2
#: How long a claimant retries a held lock (:func:`lock_held` holds it for microseconds; a run for its life).
RETRY_S = 0.02

_HELD: dict[int, Path] = {}  # open lock descriptors of this process -> their file


def _close_in_child() -> None:
    """A forked child must not keep its parent's claim: closing (not unlocking) drops only its reference."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _positive(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0 else None


def read_owner(data: bytes) -> dict[str, Any]:
    """The owner a lock file names, keeping only well-formed fields (any content is fine: it is informational)."""
    try:
        owner = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}
    if not isinstance(owner, dict):
        return {}
    out: dict[str, Any] = {}
    pid = owner.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31:
        out["pid"] = pid
    host = owner.get("host")
    if isinstance(host, str) and 0 < len(host) <= 255 and host.isprintable():
        out["host"] = host
    for key in ("started", "ended"):
        if _positive(owner.get(key)) is not None:
            out[key] = float(owner[key])
    if owner.get("v") == LOCK_VERSION:
        out["v"] = LOCK_VERSION
    return out


def describe(owner: dict[str, Any]) -> str:
    """``pid 123 on host-b (started 2026-12-01 19:00:00 UTC)``, or what is known of it."""
    who = f"pid {owner['pid']}" if "pid" in owner else "an unknown process"
    if "host" in owner:
        who += f" on {owner['host']}"
    if "started" in owner:
        who += f" (started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(owner['started']))})"
    return who


def _read(fd: int) -> bytes:
    try:
        return os.pread(fd, 65536, 0)
    except OSError:
        return b""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _open_lock(lock: Path, where: str) -> tuple[int, bool]:
    """An open descriptor of ``lock`` (a regular file, never through a link) and whether it was created here."""
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK
    for _ in range(10):
        try:
            fd, created = os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, created = os.open(lock, flags), False
            except FileNotFoundError:
                continue  # removed between the two opens: try again
            except OSError as err:
                try:
                    mode = os.lstat(lock).st_mode
                except OSError:
                    mode = stat.S_IFREG
                if stat.S_ISREG(mode):  # e.g. another user's lock: not ours to take
                    raise ConfigError(f"{where}: cannot open {LOCK} ({err.strerror or err})") from None
                raise ConfigError(f"{where}: {LOCK} is {_kind(mode)}, not a lock file; remove it "
                                  f"(rm -r {shlex.quote(str(lock))}) if no run uses the directory") from None
        except OSError as err:
            raise ConfigError(f"{where}: cannot create {LOCK} ({err.strerror or err})") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
            os.close(fd)
            kind = _kind(info.st_mode) if not stat.S_ISREG(info.st_mode) else "a hard link to another file"
            raise ConfigError(f"{where}: {LOCK} is {kind}, not a lock file; remove it "
                              f"(rm -r {shlex.quote(str(lock))}) if no run uses the directory")
        return fd, created
    raise ConfigError(f"{where}: {LOCK} keeps disappearing; is another program deleting it?")


def _lock(fd: int) -> bool:
    """Take the exclusive lock without waiting for a run (retrying briefly for a momentary holder)."""
    deadline = time.monotonic() + RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _same_file(fd: int, lock: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.lstat(lock)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _alive_here(pid: int) -> bool:
    if pid <= 0:  # 0 and -1 name process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def lock_held(lock: Path) -> bool:
    """Whether some process holds ``lock`` now (its run is alive), without keeping it; False for no lock.

    For readers such as the report. Takes a shared lock for an instant, so a
    claimant racing with it retries for :data:`RETRY_S` instead of failing.
    """
    try:
        fd = os.open(lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass
class RunClaim:
    """A claimed run directory: the open, locked ``.run.lock``. :meth:`release` gives it back."""

    path: Path
    fd: int | None

    def release(self) -> None:
        """Record a clean end in the lock file and drop the lock (idempotent; the file stays as a record)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        _HELD.pop(fd, None)
        try:
            owner = read_owner(_read(fd))
            if owner.get("pid") == os.getpid():
                _write_owner(fd, {**owner, "ended": time.time()})
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the only descriptor drops the flock


def _write_owner(fd: int, owner: dict[str, Any]) -> None:
    data = json.dumps(owner).encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)


def _takeover_command(run_dir: Path, resume: bool) -> str:
    if resume:
        return f"python -m pipeline resume={shlex.quote(str(run_dir))} rundir.take_over=true"
    return "the same command with rundir.take_over=true"


def _check_owner(owner: dict[str, Any], where: str, run_dir: Path, resume: bool) -> None:
    """Refuse a lock nobody holds here but whose run may live on: on another host, or an old pid-file claim."""
    if "ended" in owner:
        return  # that run said goodbye
    host, me = owner.get("host"), socket.gethostname()
    if host is not None and host != me:
        raise ConfigError(f"{where}: {LOCK} was claimed by {describe(owner)}, and a file lock may not reach "
                          f"across machines, so it may still run there; if that run is gone, take it over "
                          f"with: {_takeover_command(run_dir, resume)}")
    if owner.get("v") != LOCK_VERSION and "pid" in owner and _alive_here(owner["pid"]) \
            and owner["pid"] != os.getpid():
        raise ConfigError(f"{where}: {LOCK} (an older pid-file claim) names {describe(owner)}, which still runs; "
                          f"if that is not the run (pids are reused), take it over with: "
                          f"{_takeover_command(run_dir, resume)}")


def _held_message(owner: dict[str, Any], where: str, lock: Path) -> str:
    if owner.get("host") == socket.gethostname() and "pid" in owner and not _alive_here(owner["pid"]):
        return (f"{where}: pid {owner['pid']} has exited, but a process it started still holds {LOCK} "
                f"(fuser -v {shlex.quote(str(lock))} names it); stop that process or pick a new directory")
    return f"{where}: the run of {describe(owner)} is still using it (it holds {LOCK}); stop it or pick a new directory"


def claim_run_dir(run_dir: Path, *, resume: bool = False, take_over: bool = False) -> RunClaim:
    """Make ``run_dir`` this run's, or raise :class:`ConfigError` saying why not (see the module docstring).

    A new run needs a directory without a run in it; ``resume`` needs one with
    a run whose owner is gone. The directory must be writable (checked by
    writing, not by permission bits). ``take_over`` takes over a lock this
    machine cannot check (another host's). The returned claim must stay
    referenced until :meth:`RunClaim.release` (or the process's exit).
    """
    where = f"hydra.run.dir={str(run_dir)!r}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}-{secrets.token_hex(4)}"
        _probe(probe)
    except OSError as err:
        raise ConfigError(f"{where}: cannot write there ({err.strerror or err})") from None
    lock = run_dir / LOCK
    for _ in range(10):
        fd, created = _open_lock(lock, where)
        locked = False
        try:
            if not _lock(fd):
                raise ConfigError(_held_message(read_owner(_read(fd)), where, lock))
            locked = True
            if not _same_file(fd, lock):
                os.close(fd)  # removed or replaced after we opened it: lock the file that is there now
                continue
            held = [name for name in RUN_FILES if (run_dir / name).exists()]
            if resume and not (run_dir / "checkpoint.pt").exists():
                raise ConfigError(f"resume={str(run_dir)!r}: no run to resume there (no checkpoint.pt)")
            if held and not resume:
                raise ConfigError(f"{where}: already holds a run ({', '.join(held)}); pick a new directory, "
                                  f"or resume=<run dir> to continue it")
            if not take_over:
                _check_owner(read_owner(_read(fd)), where, run_dir, resume)
            try:
                _write_owner(fd, {"v": LOCK_VERSION, "pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.time()})
            except OSError as err:
                raise ConfigError(f"{where}: cannot write {LOCK} ({err.strerror or err})") from None
        except BaseException:
            if created and locked and _same_file(fd, lock):
                # a refused run leaves nothing behind; only while holding the lock (else it may be the
                # winner's by now), and whoever locked this file meanwhile finds it gone and retries
                lock.unlink(missing_ok=True)
            os.close(fd)
            raise
        _HELD[fd] = lock
        return RunClaim(lock, fd)
    raise ConfigError(f"{where}: {LOCK} keeps being replaced; is another program deleting it?")


def _probe(path: Path) -> None:
    """Create and remove a file: the directory is writable (a planted link at the name is refused, not followed)."""
    create_exclusive(path, b"ok")
    path.unlink()
