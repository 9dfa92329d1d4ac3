"""Watching a running collector graph: failures, stalls and where worker time goes.

The driver consults a :class:`GraphMonitor` while it waits for chunks: a
failed or vanished worker or a dead server is an error that names
it; so is a stall, when no chunk completes for ``stall_timeout`` seconds
while the consumer waits and everything is alive (an env that hangs, a
server that stopped answering, a chunk budget too small to ever fill a
batch). Time the consumer spends elsewhere (a slow trainer) is backpressure
and never counts.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from components.collector.worker import ACTIVITIES, EXITED, FAILED, RUNNING, STEPPING, TIMING, WorkerControl


class CollectorError(RuntimeError):
    """A worker or the server failed, or collection stalled; the message names which and why."""


class GraphMonitor:
    """Health checks, the stall watchdog and worker timing of one collector."""

    def __init__(self, control: WorkerControl, workers: Any, server: Any, env_ids: list[tuple[int, int]],
                 stall_timeout: float | None, step_timeout: float | None = None) -> None:
        self.control, self.workers, self.server = control, workers, server
        self.env_ids = env_ids  # (first, last) env of each worker
        self.stall_timeout = stall_timeout
        self.step_timeout = step_timeout
        #: ``(worker, cause) -> bool``: replace a dead worker (True) or let the run fail (False)
        self.restart: Any = None
        #: ``(cause) -> bool``: replace a dead server (and with it every worker) or let the run fail
        self.restart_server: Any = None
        self._lock = threading.RLock()
        self._timing_mark: tuple[float, np.ndarray] | None = None

    def check_health(self) -> None:
        """Raise :class:`CollectorError` if a worker or the server is gone (the server first: workers fail with it).

        With restart hooks set, a dead part is replaced instead while the
        budget lasts. One thread at a time: the replay writer and the
        trainer's weight pushes both check.
        """
        with self._lock:
            self._check_health()

    def _check_health(self) -> None:
        if not self.server.is_alive:
            detail = self.server.error or "it exited"
            cause = f"inference server ({self.server.backend}) died: {detail}"
            if self.restart_server is None or not self.restart_server(cause):
                raise CollectorError(cause)
            return  # every worker was relaunched with it
        status = self.control.status
        for w in range(len(self.env_ids)):
            if status[w] == FAILED:
                self._worker_down(w, self.control.error(w))
            elif not self.workers.alive(w) and status[w] != EXITED:
                self._worker_down(w, f"env worker {w} stopped unexpectedly: {self.workers.exit_description(w)}")
        if self.step_timeout is not None:
            self._check_hangs()

    def _worker_down(self, worker: int, cause: str) -> None:
        if self.restart is None or not self.restart(worker, cause):
            raise CollectorError(cause)

    def _check_hangs(self) -> None:
        """A worker stuck in one env step longer than ``step_timeout`` is hung: kill it (a process) and fail."""
        now = time.monotonic()
        control = self.control
        for w, (first, last) in enumerate(self.env_ids):
            if control.status[w] != RUNNING or control.activity[w] != STEPPING:
                continue
            stuck = now - float(control.heartbeat[w])
            if stuck <= self.step_timeout:
                continue
            step = int(control.timing[w, TIMING.index("steps")]) + 1
            cause = (f"env worker {w} (envs {first}-{last}) hung in its step {step}: no env of its block returned "
                     f"for {stuck:.0f} s (workers.step_timeout={self.step_timeout:g})")
            if self.workers.backend != "process":
                raise CollectorError(f"{cause}; a thread cannot be killed, so the run stops "
                                     "(use workers=process to contain hangs)")
            self.workers.kill(w)
            self._worker_down(w, f"{cause}; its process was killed")

    def wait_for(self, state: int, timeout: float) -> None:
        """Block until every worker is ``RUNNING`` (built its envs) or ``PAUSED`` (parked), or exited.

        Health is checked while waiting, so a worker that fails instead says why.
        """
        control = self.control
        deadline = time.monotonic() + timeout
        while True:
            reached = [control.status[w] == EXITED or control.status[w] == FAILED
                       or (control.status[w] == RUNNING if state == RUNNING else bool(control.paused[w]))
                       for w in range(len(self.env_ids))]
            self.check_health()
            if all(reached):
                return
            if time.monotonic() > deadline:
                what = "start" if state == RUNNING else "pause"
                error = CollectorError if state == RUNNING else TimeoutError
                raise error(f"env workers did not {what} within {timeout:.0f} s")
            time.sleep(0.002)

    def check_stall(self, waiting_since: float) -> None:
        """Raise if the consumer has waited ``stall_timeout`` s for a chunk (pauses excepted)."""
        if self.stall_timeout is None or self.control.pause[0]:
            return
        waited = time.monotonic() - waiting_since
        if waited >= self.stall_timeout:
            raise CollectorError(self.stall_report(waited))

    def stall_report(self, waited: float) -> str:
        """One line: how long nothing arrived, and what each worker is doing."""
        now = time.monotonic()
        parts = []
        for w, (first, last) in enumerate(self.env_ids):
            activity = ACTIVITIES[int(self.control.activity[w])]
            idle = now - float(self.control.heartbeat[w])
            parts.append(f"worker {w} (envs {first}-{last}) {activity}, last step {idle:.1f} s ago")
        server = f"inference server ({self.server.backend}) {'alive' if self.server.is_alive else 'dead'}"
        return (f"collection stalled: no chunk of transitions completed in {waited:.0f} s while the trainer "
                f"waited (collector.stall_timeout={self.stall_timeout:g}): " + "; ".join(parts) + f"; {server}")

    def worker_stats(self) -> dict[str, Any]:
        """Where worker time went since the last call, as fractions of wall time.

        ``env`` (stepping envs), ``infer_wait`` (waiting for actions) and
        ``chunk_wait`` (waiting for a free chunk: the trainer is the
        bottleneck); per worker and averaged, plus frames/s, the rows the
        workers sent to the server in the interval and which share dominates.
        """
        now = time.monotonic()
        timing = self.control.timing.copy()
        if self._timing_mark is None:
            self._timing_mark = (now, timing)
            return {}
        since, before = self._timing_mark
        self._timing_mark = (now, timing)
        wall = max(now - since, 1e-9)
        delta = timing - before
        out: dict[str, Any] = {}
        names = ("env", "infer_wait", "chunk_wait")
        for w in range(delta.shape[0]):
            for c, name in enumerate(names):
                out[f"worker{w}/{name}_frac"] = float(delta[w, c] / wall)
        for c, name in enumerate(names):
            out[f"{name}_frac"] = float(delta[:, c].mean() / wall)
        out["worker_frames_per_s"] = float(delta[:, TIMING.index("frames")].sum() / wall)
        out["rows_requested"] = int(delta[:, TIMING.index("rows_requested")].sum())
        out["non_finite_skipped"] = int(timing[:, TIMING.index("non_finite_skipped")].sum())  # over the run
        fracs = {name: out[f"{name}_frac"] for name in names}
        out["bound"] = max(fracs, key=fracs.get)  # type: ignore[arg-type]
        return out

    def mark(self) -> None:
        """Start the first timing interval now."""
        self._timing_mark = (time.monotonic(), self.control.timing.copy())
