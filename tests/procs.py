"""Finding a run's spawned children from ``/proc``: what the chaos tests and the chaos table kill or freeze.

No psutil: ``/proc`` says all we need (parent, state, start time, command
line, name) and the tests must not grow a dependency to look at it.
"""

from __future__ import annotations

from pathlib import Path


def spawned_children(parent: int) -> list[tuple[int, int, str]]:
    """``(start time, pid, name)`` of ``parent``'s live spawned children, oldest first.

    Only multiprocessing's spawned processes (workers, the server, the sinks'
    process) count; its resource tracker and zombies are left out.
    """
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
            name = (entry / "comm").read_text().strip()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and b"spawn_main" in cmdline \
                and b"resource_tracker" not in cmdline:
            out.append((int(fields[19]), int(entry.name), name))
    return sorted(out)


def _held_shm() -> set[str]:
    """Names under /dev/shm whose file some live process has mapped (by inode: glibc maps a semaphore under a
    temporary name and links it to its name after, so ``/proc/*/maps`` shows the temporary one)."""
    import os

    inodes: set[int] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone meanwhile, or not ours
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                inodes.add(int(fields[4]))
    held = set()
    for name in os.listdir("/dev/shm"):
        try:
            if os.stat(f"/dev/shm/{name}").st_ino in inodes:
                held.add(name)
        except OSError:
            continue
    return held


def leaked_shm(before: set[str], settle_s: float = 1.0) -> set[str]:
    """Names added to /dev/shm since ``before`` that no live process holds: what a dead run left behind.

    Another test's live run (the suite runs two at a time) holds its own names, and a name its run
    unlinks a moment later is gone on the second look ``settle_s`` later; only an orphan is in both.
    """
    import os
    import time

    first = set(os.listdir("/dev/shm")) - before - _held_shm()
    if not first:
        return first
    time.sleep(settle_s)
    return first & (set(os.listdir("/dev/shm")) - _held_shm())
