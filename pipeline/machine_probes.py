"""Probes of this machine across processes: a wake-up, and the copy bandwidth CPUs share.

They start bare interpreters (``-I -S``: no site, no numpy, ~20 ms each)
so that what they time is the machine, not this package's imports; the
layout probes (:mod:`pipeline.layout_probes`) call them.
"""

from __future__ import annotations

import time

import numpy as np

#: Bytes a probe copies or spreads its rows over, as a worker streams through its chunks: a frame this
#: big is written out of the caches, as in a run (a 100 KB frame copied into a chunk took ~22 us on the
#: 2-CPU machine against ~4 us into a buffer that stays cached).
STREAM_BYTES = 32 << 20


_COPIER = ("import sys,time\nn,k=int(sys.argv[1]),int(sys.argv[2])\na=bytearray(n);b=bytearray(n);b[:]=a\n"
           "print(0,flush=True)\nwhile sys.stdin.readline():\n t=time.perf_counter()\n"
           " for _ in range(k): b[:]=a\n print(time.perf_counter()-t,flush=True)\n")
#: Observations at least this big get the shared-bandwidth probe (smaller ones never stream memory).
BIG_FRAME_BYTES = 64 << 10


def time_shared_copy(cpus: int, round_s: float = 0.05, rounds: int = 2) -> float:
    """The share of its copy bandwidth a process keeps when every CPU copies at once (1.0: none lost).

    Big frames are streamed through memory by every worker and the driver
    at once, and each copy was probed alone: on the 2-CPU machine the
    model predicted 15,000-18,600 frames/s of raw frames for runs that
    made 10,300-13,400. Here the same copy (``bytearray`` slices, which
    are memmoves, 32 MB) runs alone, then in ``cpus`` processes at once
    (bare interpreters, ``-I -S``), in rounds of ~50 ms: long enough that
    where the scheduler first puts a woken process does not count.
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
    children = [subprocess.Popen([sys.executable, "-I", "-S", "-c", _COPIER, str(STREAM_BYTES), str(k)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(cpus - 1)]

    def copies() -> float:
        t = time.perf_counter()
        for _ in range(k):
            dst[:] = src
        return time.perf_counter() - t

    try:
        for child in children:  # ready: nothing else copies while the copy is timed alone
            if child.stdout is None or not child.stdout.readline():
                return 1.0
        alone = min(copies() for _ in range(rounds))
        together = []
        for _ in range(rounds):
            for child in children:
                assert child.stdin is not None
                child.stdin.write("go\n")
                child.stdin.flush()
            times = [copies()] + [float(child.stdout.readline() or "nan") for child in children
                                  if child.stdout is not None]
            together.append(float(np.mean(times)))
        share = alone / min(together)
        return float(min(1.0, max(0.05, share))) if share == share else 1.0
    finally:
        for child in children:
            try:
                if child.stdin is not None:
                    child.stdin.close()
                child.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                child.kill()
                child.wait(1)


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
