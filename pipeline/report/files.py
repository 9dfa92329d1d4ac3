"""Opening files the report reads or serves, so that an odd file is a note in the page, never a hang or a leak.

Everything under a report's root was written by runs, or by whoever else can
write there (a downloaded or shared run directory, another user of a shared
disk). So every file is opened the same careful way:

- ``lstat`` first, and only a regular file is opened: a FIFO named
  ``metrics.jsonl`` would block ``open()`` forever, a device could stream
  without end, a socket cannot be read at all;
- ``O_NOFOLLOW | O_NONBLOCK`` on the open itself and ``fstat`` after it, so a
  file swapped for a link or a FIFO between the two calls is refused too;
- :func:`open_beneath` walks a relative path one component at a time with
  ``O_NOFOLLOW`` from an already opened directory: what ``--serve`` sends can
  never be reached through a symlink, whatever the path spells.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC


class NotRegular(OSError):
    """The path exists but is not a regular file (its kind is in the message)."""


def kind_of(mode: int) -> str:
    """A short word for what a non-regular file is, as the report names it."""
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return word
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A read-only fd of ``path`` when it is a regular file (not through a final symlink).

    Raises ``FileNotFoundError`` when it is missing, :class:`NotRegular` when it
    is anything else than a regular file, ``OSError`` when it cannot be opened.
    """
    st = os.lstat(path, dir_fd=dir_fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(f"{kind_of(st.st_mode)}, skipped")
    fd = os.open(path, READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between lstat and open
            raise NotRegular(f"{kind_of(st.st_mode)}, skipped")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(path: str | os.PathLike[str], cap: int) -> bytes:
    """The bytes of a small regular file; ``ValueError`` when it holds more than ``cap`` bytes."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise ValueError(f"larger than {cap} bytes")
    return data


def iter_lines(fd: int, max_len: int) -> Iterator[bytes | None]:
    """The lines of an open file (without the newline); ``None`` for each line longer than ``max_len`` bytes.

    A too long line is skipped in ``max_len`` pieces, so one 2 GB line of
    garbage costs a scan, not 2 GB of memory. The fd is closed at the end.
    """
    with os.fdopen(fd, "rb") as fh:
        while True:
            line = fh.readline(max_len + 1)
            if not line:
                return
            if len(line) > max_len and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):
                    line = fh.readline(max_len + 1)
                yield None
                continue
            yield line.rstrip(b"\r\n")


def open_beneath(root_fd: int, parts: list[str]) -> int:
    """An fd of the regular file ``root/parts...``, never through a symlink, a ``..`` or a non-regular file.

    Each directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the
    previous one, so neither a link in the middle nor a rename racing the walk
    can lead outside ``root``. Raises ``OSError`` (or :class:`NotRegular`).
    """
    if not parts or any(p in ("", ".", "..") or "/" in p or "\0" in p for p in parts):
        raise FileNotFoundError("not a plain relative path")
    current = root_fd
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=current)
            if current != root_fd:
                os.close(current)
            current = nxt
        return open_regular(parts[-1], dir_fd=current)
    finally:
        if current != root_fd:
            os.close(current)
