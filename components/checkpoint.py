"""Atomic checkpoints: a crash mid-write never leaves a truncated file behind."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` via a temporary file, fsync and rename.

    ``os.replace`` is atomic on POSIX: readers see the old checkpoint or the
    new one, never a partial file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    # Serialised in memory first: torch's zip writer turns a failed write (a full disk) into a
    # RuntimeError about file positions; a plain write says ENOSPC.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        with open(tmp, "wb") as fh:
            fh.write(buffer.getbuffer())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise OSError(err.errno, f"{err.strerror} (writing {path})") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> dict[str, Any]:
    return torch.load(Path(path), map_location=map_location, weights_only=False)
