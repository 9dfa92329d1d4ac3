"""Writing a file so that readers see the old one or the new one, and a planted link redirects nothing.

Every file a run or the report rewrites (checkpoint, lock, metrics after a
rewind, ``.hydra/*.yaml``, ``report.html``) goes through :func:`write_atomic`:

- the temporary file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``, so a
  symlink (or any file) planted under its name by another user of a shared
  directory makes the write fail instead of following the link;
- the data is fsynced before the rename and the directory after it: without
  the second fsync a power cut can forget the rename, leaving the previous
  checkpoint (or none) although the run said it wrote one;
- the file is created with ``mode`` (0600 by default: weights and stored
  observations are the user's, not every local account's).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

#: Flags of every temporary file: never reuse a name, never follow a link.
TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def fsync_dir(directory: str | Path) -> None:
    """Make a rename or create in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (tmpfs on old kernels, network mounts) refuse fsync on a directory
    finally:
        os.close(fd)


def create_exclusive(path: str | Path, data: bytes, mode: int = 0o600) -> None:
    """Create ``path`` holding ``data``; fails with ``FileExistsError`` if any entry (a link too) has its name."""
    fd = os.open(path, TMP_FLAGS, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def write_atomic(path: str | Path, data: bytes | str, mode: int = 0o600) -> Path:
    """Replace ``path`` with ``data`` atomically and durably (see the module docstring).

    The temporary file sits beside ``path`` (same file system, so the rename
    is atomic) under a random name; it is removed when anything fails.
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    create_exclusive(tmp, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path
