"""Name the calling thread for ``ps``/``top`` (``/proc/<pid>/comm``): which child is which.

Every spawned child is otherwise a ``python`` running ``spawn_main``; when a
watchdog reports a hung env worker or server, ``ps -o pid,comm`` (or
``top -H``) should show which process that is. Called in a child's main
thread it names the process; in a thread, that thread only. Best effort:
nothing happens where ``prctl`` is missing.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15
_COMM_BYTES = 15  # the kernel keeps 15 bytes and a NUL


def set_name(name: str) -> None:
    """Set the kernel's name of the calling thread to ``name`` (cut to 15 bytes)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode("ascii", "replace")[:_COMM_BYTES]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
