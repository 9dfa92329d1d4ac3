"""Atomic checkpoints: a crash mid-write never leaves a truncated file behind."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(path: str | Path, state: dict[str, Any], mode: int = 0o666) -> Path:
    """Write ``state`` to ``path`` atomically and durably (:func:`components.atomic_files.write_atomic`).

    Readers see the old checkpoint or the new one, never a partial file; the
    temporary file is created ``O_EXCL | O_NOFOLLOW`` (a link planted at its
    name is refused, not followed), the data and then the directory are
    fsynced (else a power cut may forget the rename). ``mode`` is masked by
    the umask, which the runner sets from ``rundir.mode`` (0600 by default).
    A failed write is an ``OSError`` naming ``(writing <path>)``.
    """
    from components.atomic_files import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Serialised in memory first: torch's zip writer turns a failed write (a full disk) into a
    # RuntimeError about file positions; a plain write says ENOSPC.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        write_atomic(path, buffer.getbuffer(), mode=mode)
    except OSError as err:
        raise OSError(err.errno, f"{err.strerror} (writing {path})") from None
    return path


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> dict[str, Any]:
    """The state :func:`save_checkpoint` wrote, loaded with ``weights_only=True``.

    Checkpoints hold tensors and plain values only (see :mod:`pipeline.runner.state`),
    so nothing needs full unpickling; with ``weights_only=False`` a checkpoint
    from someone else (a downloaded run directory) could run any code on load.
    """
    return torch.load(Path(path), map_location=map_location, weights_only=True)
