"""Probes of this machine across processes: a wake-up, and the copy bandwidth CPUs share.

They start bare interpreters (``-I -S``: no site, no numpy, ~20 ms each)
so that what they time is the machine, not this package's imports; the
layout probes (:mod:`pipeline.plan.probes`) call them.
"""

from __future__ import annotations

import time

import numpy as np

from components.lifecycle import children_ignore_signals

#: Bytes a probe copies or spreads its rows over, as a worker streams through its chunks: a frame this
#: big is written out of the caches, as in a run (a 100 KB frame copied into a chunk took ~22 us on the
#: 2-CPU machine against ~4 us into a buffer that stays cached).
STREAM_BYTES = 32 << 20


_COPIER = ("import sys,time\nn,k=int(sys.argv[1]),int(sys.argv[2])\na=bytearray(n);b=bytearray(n);b[:]=a\n"
           "print(0,flush=True)\nwhile sys.stdin.readline():\n t=time.perf_counter()\n"
           " for _ in range(k): b[:]=a\n print(time.perf_counter()-t,flush=True)\n")
#: Observations at least this big get the shared-bandwidth probe (smaller ones never stream memory).
BIG_FRAME_BYTES = 64 << 10


#: seconds a copier may take to start (a bare interpreter and 64 MB), and to answer one round
COPIER_START_TIMEOUT_S = 30.0
COPIER_ROUND_TIMEOUT_S = 10.0


def _read_line(fd: int, timeout: float) -> str | None:
    """One line from a child's pipe, or None when it closed it or said nothing for ``timeout`` seconds.

    A copier answers each request with exactly one line, so nothing past it
    is ever read (and lost) here.
    """
    import os
    import select

    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        piece = os.read(fd, 256)
        if not piece:
            return None
        data += piece
    return data.decode()


def time_shared_copy(cpus: int, round_s: float = 0.05, rounds: int = 2, copier: str = _COPIER) -> float:
    """The share of its copy bandwidth a process keeps when every CPU copies at once (1.0: none lost).

    Big frames are streamed through memory by every worker and the driver
    at once, and each copy was probed alone: on the 2-CPU machine the
    model predicted 15,000-18,600 frames/s of raw frames for runs that
    made 10,300-13,400. Here the same copy (``bytearray`` slices, which
    are memmoves, 32 MB) runs alone, then in ``cpus`` processes at once
    (bare interpreters, ``-I -S``), in rounds of ~50 ms: long enough that
    where the scheduler first puts a woken process does not count.

    A copier that dies or hangs makes the probe say 1.0 (no share lost,
    the model without this term) within the timeouts above; it never
    blocks the plan. ``copier``: the child's program (tests hand in broken ones).
    """
    import subprocess
    import sys

    if cpus <= 1:
        return 1.0
    src, dst = bytearray(STREAM_BYTES), bytearray(STREAM_BYTES)
    dst[:] = src
    started = time.perf_counter()
    dst[:] = src
    per_copy = max(1e-6, time.perf_counter() - started)
    k = max(2, int(round_s / per_copy))
    with children_ignore_signals():  # a Ctrl-C is the runner's to handle: a copier ends when its stdin closes
        children = [subprocess.Popen([sys.executable, "-I", "-S", "-c", copier, str(STREAM_BYTES), str(k)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
                    for _ in range(cpus - 1)]

    def copies() -> float:
        t = time.perf_counter()
        for _ in range(k):
            dst[:] = src
        return time.perf_counter() - t

    def answers(timeout: float) -> list[float] | None:
        out = []
        for child in children:
            assert child.stdout is not None
            line = _read_line(child.stdout.fileno(), timeout)
            try:
                out.append(float(line or "x"))
            except ValueError:
                return None
        return out

    try:
        if answers(COPIER_START_TIMEOUT_S) is None:  # ready: nothing else copies while the copy is timed alone
            return 1.0
        alone = min(copies() for _ in range(rounds))
        together = []
        for _ in range(rounds):
            for child in children:
                assert child.stdin is not None
                child.stdin.write(b"go\n")
            own = copies()
            theirs = answers(COPIER_ROUND_TIMEOUT_S)
            if theirs is None:
                return 1.0
            together.append(float(np.mean([own] + theirs)))
        share = alone / min(together)
        return float(min(1.0, max(0.05, share))) if share == share else 1.0
    except (OSError, ValueError):  # a copier gone mid-write (a broken pipe)
        return 1.0
    finally:
        for child in children:
            try:
                if child.stdin is not None:
                    child.stdin.close()
                child.wait(2)
            except (OSError, subprocess.TimeoutExpired):
                child.kill()
                child.wait(5)


_ECHO = "import os,sys\nr,w=int(sys.argv[1]),int(sys.argv[2])\nwhile True:\n b=os.read(r,1)\n if not b: break\n os.write(w,b)\n"


def time_hop(rounds: int = 400) -> float:
    """One cross-process wake-up: half a ping-pong round trip with a bare interpreter (``-I -S``, ~20 ms to start).

    Over pipes rather than the slot transport's semaphores: both wake a
    sleeping process through the kernel, and a bare child needs none of
    this package's imports (a spawned one would import numpy and the
    runner first).
    """
    import os
    import subprocess
    import sys

    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    with children_ignore_signals():  # a Ctrl-C is the runner's to handle: the echo ends when its pipe closes
        child = subprocess.Popen([sys.executable, "-I", "-S", "-c", _ECHO, str(down_r), str(up_w)],
                                 pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL)
    os.close(down_r)
    os.close(up_w)
    import select

    def round_trip(timeout: float) -> None:
        os.write(down_w, b"x")
        if not select.select([up_r], [], [], timeout)[0] or not os.read(up_r, 1):
            raise TimeoutError("the wake-up probe's child did not answer")

    try:
        for _ in range(20):  # warm-up (and the child's start)
            round_trip(10.0)
        start = time.perf_counter()
        for _ in range(rounds):
            round_trip(1.0)
        return (time.perf_counter() - start) / rounds / 2
    finally:
        os.close(down_w)
        os.close(up_r)
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(1)
