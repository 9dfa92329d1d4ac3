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
