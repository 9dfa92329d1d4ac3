"""A run directory's files and mode: ``.hydra/`` written as Hydra would, the disk reserve, the umask.

Claiming the directory (one run per directory, an ``flock`` on ``.run.lock``) is
:mod:`pipeline.runner.run_lock`.

Why ``rundir.mode`` (default ``private``): a run directory holds weights,
stored observations (a disk replay), configs and logs; on a shared machine
they are nobody else's business. The driver sets its umask (0o077) before
Hydra creates the directory and before any child starts, so every file any
part of the run creates (wandb, TensorBoard, replay memmaps, checkpoints)
follows: directories 0700, files 0600. ``group`` gives 0750/0640,
``shared`` keeps the user's umask (the old 0755/0644).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from components.atomic_files import write_atomic
from pipeline.plan.validate import ConfigError

#: ``rundir.mode`` -> the umask the driver runs under (None: leave the user's).
MODES: dict[str, int | None] = {"private": 0o077, "group": 0o027, "shared": None}
#: Overrides that act once, at the claim, and are never saved for a later resume to replay.
ONE_SHOT = ("rundir.take_over",)

_USER_UMASK: list[int] = []  # the umask this process started with (what ``shared`` goes back to)


def apply_mode(mode: str) -> int:
    """Set the process umask for ``rundir.mode``; returns the previous one (to restore it after a run)."""
    if mode not in MODES:
        raise ConfigError(f"rundir.mode={mode!r}: one of {', '.join(MODES)} (private: run directories 0700, "
                          "files 0600; group: 0750/0640; shared: your umask)")
    if not _USER_UMASK:
        _USER_UMASK.append(os.umask(0o077))
        os.umask(_USER_UMASK[0])
    mask = MODES[mode]
    return os.umask(_USER_UMASK[0] if mask is None else mask)


def write_hydra_files(run_dir: Path, task_config: Any, hydra_config: Any, overrides: list[str]) -> None:
    """What Hydra would have written into ``.hydra/``: the composed config, Hydra's and the overrides.

    Written atomically (no planted link followed, fsynced); one-shot
    overrides (:data:`ONE_SHOT`) are not saved, so a later resume does not
    repeat a take-over.
    """
    from omegaconf import OmegaConf

    out = run_dir / ".hydra"
    out.mkdir(exist_ok=True)
    kept = [o for o in overrides if str(o).split("=", 1)[0].lstrip("+~") not in ONE_SHOT]
    for name, node in (("config.yaml", task_config), ("hydra.yaml", hydra_config)):
        write_atomic(out / name, OmegaConf.to_yaml(node), mode=0o666)  # the umask (rundir.mode) decides
    write_atomic(out / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(kept))), mode=0o666)


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
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o644)  # a planted link is refused, not truncated
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
