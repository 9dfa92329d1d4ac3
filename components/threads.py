"""The thread pools of every process the pipeline starts, pinned before numpy or torch load.

numpy's OpenBLAS, torch's OpenMP and MKL each start one thread per CPU by
default. Two processes on two cores that both multiply a batch big enough
for BLAS to split then spin against each other: measured on CartPole with
1,024 envs in two inline workers, 48,244 frames/s against 212,937 at 256
envs (and a plan that predicted 202,627). A library sizes its pool when it
loads, and a spawned child loads numpy while it unpickles its arguments,
before its target runs. So a process is started inside :func:`child_pools`
(the sizes go into the child's environment, read at its first import), and
its entry calls :func:`pin_pools`, which also limits what is loaded already
(threadpoolctl), torch's intra-op pool, and what the process's own children
inherit.

``RLPIPELINE_POOLS_DIR``: when set, :func:`report_pools` writes what a
process's pools hold to ``<dir>/<role>-<pid>.json`` (the check that every
kind of process got what the plan says; a diagnosis of oversubscription).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The variables BLAS and OpenMP runtimes read when they load (torch's intra-op pool reads the OpenMP one).
POOL_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
             "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "OPENCV_FOR_THREADS_NUM")
REPORT_DIR_VAR = "RLPIPELINE_POOLS_DIR"

#: os.environ is process-wide: two threads starting children with different sizes must take turns.
_START_LOCK = threading.RLock()


@contextlib.contextmanager
def child_pools(threads: int) -> Iterator[None]:
    """Processes started inside this block size their pools to ``threads`` from their first import.

    The parent's own pools are not touched (its libraries are loaded
    already); its environment holds the sizes only while the block runs.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    with _START_LOCK:
        saved = {var: os.environ.get(var) for var in POOL_VARS}
        os.environ.update({var: str(threads) for var in POOL_VARS})
        try:
            yield
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value


def pin_pools(threads: int, torch_threads: int | None = None) -> None:
    """Size this process's pools: ``threads`` for BLAS/OpenMP, ``torch_threads`` (default the same) for torch.

    Sets the variables for what loads later and for children, limits the
    libraries loaded already, and torch's intra-op pool if torch is loaded
    (a process that never imports torch does not pay for it here).
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    with _START_LOCK:
        os.environ.update({var: str(threads) for var in POOL_VARS})
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")
    torch = sys.modules.get("torch")
    if torch is not None:
        # torch keeps one process-wide size, which each thread adopts at its next parallel region.
        torch.set_num_threads(int(torch_threads or threads))
    else:
        threadpool_limits(limits=threads, user_api="openmp")
    cv2 = sys.modules.get("cv2")  # Atari preprocessing's resize: OpenCV keeps a pool of its own
    if cv2 is not None and hasattr(cv2, "setNumThreads"):
        cv2.setNumThreads(threads)


def pools() -> dict[str, Any]:
    """What this process's pools hold now: each loaded BLAS/OpenMP library's threads, and torch's."""
    from threadpoolctl import threadpool_info

    out: dict[str, Any] = {"libraries": [{"user_api": lib["user_api"], "internal_api": lib["internal_api"],
                                          "num_threads": lib["num_threads"], "prefix": lib["prefix"]}
                                         for lib in threadpool_info()]}
    torch = sys.modules.get("torch")
    out["torch"] = torch.get_num_threads() if torch is not None else None
    out["env"] = {var: os.environ.get(var) for var in POOL_VARS}
    out["start_env"] = _start_environment()
    return out


def _start_environment() -> dict[str, str | None] | None:
    """The pool variables this process was started with (Linux: what its first import read), or None."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    start = dict(item.split("=", 1) for item in raw.decode("utf-8", "replace").split("\0") if "=" in item)
    return {var: start.get(var) for var in POOL_VARS}


def report_pools(role: str) -> None:
    """Write :func:`pools` to ``$RLPIPELINE_POOLS_DIR/<role>-<pid>.json`` when that variable is set.

    Called where a process has loaded what it runs (its envs, its model),
    so the libraries those loaded are in the report too. torch is imported
    for the report if the process has not loaded it: what it would get.
    """
    where = os.environ.get(REPORT_DIR_VAR)
    if not where:
        return
    import torch  # noqa: F401 - reported below: the size this process would run torch with

    data = {"role": role, "pid": os.getpid(), **pools()}
    path = Path(where) / f"{role}-{os.getpid()}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as err:  # a diagnosis must never stop the process it describes
        print(f"warning: could not write the pools report {path}: {err}", file=sys.stderr)
