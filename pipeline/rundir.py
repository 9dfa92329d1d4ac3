"""Claiming a run directory: one run per directory, decided atomically.

Two runs started in the same second must never write into one directory,
and a refused run must not touch the directory it was refused. The claim is
an exclusive create (``O_CREAT | O_EXCL``) of ``.run.lock`` holding the
owner's pid: the file system decides the race. The lock stays after the run
ends; it only blocks while its pid is alive, so ``resume=<run dir>`` can
take over the directory of a run that finished, stopped or was killed.
Hydra's own ``.hydra/`` files are written by the runner after the claim
(``hydra.output_subdir`` is null), never before it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from pipeline.validate import ConfigError

LOCK = ".run.lock"
#: Files that mark a directory as holding a run (also without a lock: older runs).
RUN_FILES = ("checkpoint.pt", "metrics.jsonl")


def _owner_alive(lock: Path) -> tuple[bool, str]:
    """Whether the process that wrote ``lock`` still runs here, and who it was."""
    try:
        owner = json.loads(lock.read_text())
    except (OSError, ValueError):
        return False, "an unreadable lock"
    pid, host = int(owner.get("pid", -1)), owner.get("host")
    who = f"pid {pid} on {host}"
    if host != socket.gethostname():
        return True, who  # another machine's run: never taken over from here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, who
    except PermissionError:
        return True, who
    return True, who


def claim_run_dir(run_dir: Path, *, resume: bool = False) -> Path:
    """Make ``run_dir`` this run's, or raise :class:`ConfigError` saying why not.

    A new run needs a directory without a run in it; ``resume`` needs one with
    a run whose owner is gone. The directory must be writable (checked by
    writing, not by permission bits). Returns the lock file.
    """
    where = f"hydra.run.dir={str(run_dir)!r}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{where}: cannot write there ({err.strerror or err})") from None
    lock = run_dir / LOCK
    held = [name for name in RUN_FILES if (run_dir / name).exists()]
    if lock.exists():
        alive, who = _owner_alive(lock)
        if alive:
            raise ConfigError(f"{where}: the run of {who} is still using it; pick a new directory")
    if resume and not (run_dir / "checkpoint.pt").exists():
        raise ConfigError(f"resume={str(run_dir)!r}: no run to resume there (no checkpoint.pt)")
    if held and not resume:
        raise ConfigError(f"{where}: already holds a run ({', '.join(held)}); pick a new directory, "
                          f"or resume=<run dir> to continue it")
    lock.unlink(missing_ok=True)  # a stale lock (a finished, killed or refused run): take it over
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise ConfigError(f"{where}: another run claimed it a moment ago; pick a new directory") from None
    with os.fdopen(fd, "w") as fh:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, fh)
    return lock


def write_hydra_files(run_dir: Path, task_config: Any, hydra_config: Any, overrides: list[str]) -> None:
    """What Hydra would have written into ``.hydra/``: the composed config, Hydra's and the overrides."""
    from omegaconf import OmegaConf

    out = run_dir / ".hydra"
    out.mkdir(exist_ok=True)
    for name, node in (("config.yaml", task_config), ("hydra.yaml", hydra_config)):
        tmp = out / f".{name}.tmp"
        tmp.write_text(OmegaConf.to_yaml(node))
        os.replace(tmp, out / name)
    tmp = out / ".overrides.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    os.replace(tmp, out / "overrides.yaml")


class DiskReserve:
    """Space kept aside in the run directory for the last checkpoint and summary.

    When the disk fills up during a run (another process, a growing log),
    every later write fails, the final checkpoint included. Like a
    database's reserve file, a preallocated ``.disk_reserve`` is removed the
    moment a write fails for lack of space, so the run can still end with
    its last metrics row, summary and checkpoint written. Released at the
    end of every run; one left by a SIGKILL is taken over by the next
    ``resume``.
    """

    NAME = ".disk_reserve"

    def __init__(self, run_dir: Path, nbytes: int) -> None:
        self.path = run_dir / self.NAME
        self.nbytes = int(nbytes)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, self.nbytes)
                else:  # pragma: no cover - not Linux
                    os.ftruncate(fd, self.nbytes)
            finally:
                os.close(fd)
        except OSError as err:
            self.path.unlink(missing_ok=True)
            raise ConfigError(f"hydra.run.dir={str(run_dir)!r}: cannot keep {self.nbytes / 1e6:.0f} MB free for the "
                              f"final checkpoint ({err.strerror or err}); free some disk space") from None

    def release(self) -> bool:
        """Give the space back; True if there was any to give."""
        try:
            self.path.unlink()
            return True
        except FileNotFoundError:
            return False
