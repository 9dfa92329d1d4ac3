"""Watching a running collector graph: failures, stalls and where worker time goes.

The driver consults a :class:`GraphMonitor` while it waits for chunks: a
failed or vanished worker or a dead server is an error that names
it; so is a stall, when no chunk completes for ``stall_timeout`` seconds
while the consumer waits and everything is alive (an env that hangs, a
server that stopped answering, a chunk budget too small to ever fill a
batch). Time the consumer spends elsewhere (a slow trainer) is backpressure
and never counts.

Hangs are found sooner and by part. Every worker and the server beat a
progress clock on every turn of their loops, and every wait in those loops
is bounded, so a live part beats a few times a second whatever it waits on
(a slow server, a trainer that holds every chunk). A worker that has not
beaten for ``step_timeout`` seconds (or whose env step has not returned
for that long) is hung wherever it is stuck: a deadlock outside
``env.step``, a process stopped by SIGSTOP or a debugger; a process worker
is killed and restarted like a crashed one. The server, when it has not
beaten for ``server_step_timeout`` seconds while requests wait, is hung:
a server process is killed and restarted within its budget. A thread cannot
be killed, so a hung thread stops the run with one line.

The driver can be stopped too (Ctrl-Z then ``fg``, a debugger): then every
clock looks stale at once although nothing hung. A small thread notices the
driver's own gaps (:meth:`GraphMonitor.watch_driver`) and every watchdog
counts from the driver's resumption instead.

A worker much slower than the others is reported too (see
:func:`slowest_worker`): with every env worker running the same env, one at
a fraction of the others' rate is a sick host CPU, a throttled or swapping
process, or a stuck env among healthy ones.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from components.collector.failures import CollectorError, Failure
from components.collector.worker_control import (
    ACTIVITIES, EXITED, FAILED, PAUSED, RUNNING, STEPPING, TIMING, WorkerControl,
)

#: A worker whose env steps/s over an interval is below this fraction of the median of the others' is slow.
SLOW_RATIO = 0.25
#: ... and is warned about once it was slow in this many intervals in a row (one restart or hiccup is not).
SLOW_INTERVALS = 2
#: A driver that did not run for this long was stopped (or starved): the watchdogs give every part a fresh start.
DRIVER_GAP_S = 1.0


def slowest_worker(rates: np.ndarray) -> tuple[int, float] | None:
    """The slowest worker and its rate over the median of the others' (None: fewer than 2, or nothing ran).

    ``rates`` are env steps per second per env (frames over the worker's env
    count), so a narrower last worker is not slow for hosting fewer envs.
    The median of the *others* keeps one slow worker from dragging its own
    yardstick down, and one fast outlier from making everyone look slow.
    """
    if rates.shape[0] < 2:
        return None
    w = int(np.argmin(rates))
    others = float(np.median(np.delete(rates, w)))
    if others <= 0:
        return None
    return w, float(rates[w] / others)


def process_state(pid: int | None) -> str:
    """What to add to a hang's line when the kernel has ``pid`` stopped (SIGSTOP, a debugger), else ''.

    A stopped process is the one frozen part a user can cause by hand (or
    a job-control slip), so the line says so instead of leaving them to guess.
    """
    if pid is None:
        return ""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return " (its process was stopped: SIGSTOP, a debugger or job control)" if state in ("T", "t") else ""


class GraphMonitor:
    """Health checks, the stall watchdog and worker timing of one collector."""

    def __init__(self, control: WorkerControl, workers: Any, server: Any, env_ids: list[tuple[int, int]],
                 stall_timeout: float | None, step_timeout: float | None = None,
                 server_step_timeout: float | None = None) -> None:
        self.control, self.workers, self.server = control, workers, server
        self.env_ids = env_ids  # (first, last) env of each worker
        self.stall_timeout = stall_timeout
        self.step_timeout = step_timeout
        self.server_step_timeout = server_step_timeout
        #: ``(worker, failure) -> bool``: replace a dead worker (True) or let the run fail (False)
        self.restart: Any = None
        #: ``(cause) -> bool``: replace a dead server (and with it every worker) or let the run fail
        self.restart_server: Any = None
        self._lock = threading.RLock()
        self._timing_mark: tuple[float, np.ndarray] | None = None
        self._beats_mark = np.zeros(len(env_ids), np.int64)
        self._slow_streak: dict[int, int] = {}  # worker -> intervals in a row it was slow
        self._slow_warned: set[int] = set()
        #: monotonic time the driver last resumed after being stopped (watchdogs count from no earlier)
        self.resumed_at = 0.0
        self._tick = 0.0  # the watcher's last turn
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch_driver(self) -> None:
        """Start the thread that notices the driver being stopped (idempotent; :meth:`stop_watching` ends it)."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="collector-watch", daemon=True)
            self._watcher.start()

    def stop_watching(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(1.0)

    def _watch(self) -> None:
        self._tick = time.monotonic()
        while not self._watch_stop.wait(0.1):
            now = time.monotonic()
            if now - self._tick > DRIVER_GAP_S:  # a 0.1 s sleep that took over a second: the driver was stopped
                self.resumed_at = now
            self._tick = now

    def _counting_from(self, now: float) -> float:
        """When the watchdogs' clocks start at the earliest: the driver's last resumption (0: never stopped).

        A check that runs before the watcher had its turn after a stop sees
        the watcher's stale tick and counts from now.
        """
        if self._watcher is not None and now - self._tick > DRIVER_GAP_S:
            self.resumed_at = now
        return self.resumed_at

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
        if self.server_step_timeout is not None and self._check_server_hang():
            return  # restarted, and every worker with it
        status = self.control.status
        for w in range(len(self.env_ids)):
            if status[w] == FAILED:
                self._worker_down(w, self.control.failure(w))
            elif not self.workers.alive(w) and status[w] != EXITED:
                self._worker_down(w, Failure(f"env worker {w} stopped unexpectedly: "
                                             f"{self.workers.exit_description(w)}"))
        if self.step_timeout is not None:
            self._check_hangs()

    def _worker_down(self, worker: int, failure: Failure) -> None:
        if self.restart is None or not self.restart(worker, failure):
            raise CollectorError(failure.message, failure.kind)

    def _check_server_hang(self) -> bool:
        """A server silent for ``server_step_timeout`` while requests wait is hung: restart it (a process) or fail.

        True when it was restarted. A server that is merely idle beats too
        (its waits are bounded), so silence means it is frozen, or stuck in
        one forward pass or weights copy for that long.
        """
        server = self.server
        silent_for = getattr(server, "silent_for", None)  # server=inline: covered by the workers' beats
        quiet = silent_for() if silent_for is not None else None
        if quiet is not None:
            now = time.monotonic()
            quiet = min(quiet, now - self._counting_from(now))
        if quiet is None or quiet <= self.server_step_timeout:
            return False
        pending = server.pending_requests()
        if not pending:
            return False
        pid = getattr(server, "pid", None)
        cause = (f"inference server ({server.backend}) hung: no progress for {quiet:.0f} s while {pending} request(s) "
                 f"waited (server.step_timeout={self.server_step_timeout:g}), last seen {server.activity}"
                 f"{process_state(pid)}")
        if server.backend != "process":
            raise CollectorError(f"{cause}; a thread cannot be killed, so the run stops "
                                 "(use server=process to contain hangs)")
        server.kill()
        cause += f"; its process was killed (pid {pid})"
        if self.restart_server is None or not self.restart_server(cause):
            raise CollectorError(cause)
        return True

    def _check_hangs(self) -> None:
        """A worker that made no progress for ``step_timeout`` is hung: kill it (a process) and restart or fail.

        No progress: no loop turn (frozen wherever it is, whatever it was
        doing), or one env step that has not returned (for concurrent envs:
        the oldest step in flight, while the worker's other envs go on).
        """
        now = time.monotonic()
        since = self._counting_from(now)
        control = self.control
        for w, (first, last) in enumerate(self.env_ids):
            if control.status[w] != RUNNING:
                continue
            activity = int(control.activity[w])
            silent = now - max(float(control.progress[w]), since)
            stuck = now - max(float(control.heartbeat[w]), since) if activity == STEPPING else 0.0
            if max(silent, stuck) <= self.step_timeout:
                continue
            pids = getattr(self.workers, "pids", None)
            pid = pids[w] if pids is not None else None
            name = f"env worker {w} (envs {first}-{last})"
            if activity == STEPPING:
                step = int(control.timing[w, TIMING.index("steps")]) + 1
                cause = (f"{name} hung in its step {step}: no env of its block returned for {max(silent, stuck):.0f} s "
                         f"(workers.step_timeout={self.step_timeout:g})")
            else:
                cause = (f"{name} hung: no progress for {silent:.0f} s, last seen {ACTIVITIES[activity]} "
                         f"(workers.step_timeout={self.step_timeout:g})")
            cause += process_state(pid)
            if self.workers.backend != "process":
                raise CollectorError(f"{cause}; a thread cannot be killed, so the run stops "
                                     "(use workers=process to contain hangs)")
            self.workers.kill(w)
            self._worker_down(w, Failure(f"{cause}; its process was killed (pid {pid})"))

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

    @contextlib.contextmanager
    def paused(self, writer_lock: Any, timeout: float) -> Iterator[None]:
        """Workers parked at a step boundary and the replay writer (holding ``writer_lock``) idle, for the block."""
        control = self.control
        control.pause[0] = 1
        locked = False
        try:
            if not writer_lock.acquire(timeout=timeout):
                raise TimeoutError(f"the replay writer did not pause within {timeout} s")
            locked = True
            self.wait_for(PAUSED, timeout)
            yield
        finally:
            if locked:
                writer_lock.release()
            control.pause[0] = 0

    def check_stall(self, waiting_since: float) -> None:
        """Raise if the consumer has waited ``stall_timeout`` s for a chunk (pauses excepted)."""
        if self.stall_timeout is None or self.control.pause[0]:
            return
        now = time.monotonic()
        waited = now - max(waiting_since, self._counting_from(now))
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
        widths = np.array([last - first + 1 for first, last in self.env_ids], np.float64)
        rates = delta[:, TIMING.index("frames")] / widths / wall  # env steps/s per env, per worker
        slowest = slowest_worker(rates)
        if slowest is not None:
            out["slowest_worker"], out["slowest_worker_ratio"] = slowest
            beats = self.control.beats.copy()
            turned = bool(beats[slowest[0]] != self._beats_mark[slowest[0]])
            self._beats_mark = beats
            # one that never turned its loop is not slow but frozen: the hang watchdog's, not a warning;
            # one that mostly waited (for actions, for chunk space) is starved by shared parts, not slowed by
            # its own envs: its ratio is logged, the warning is for envs that are slow
            stepping = float(delta[slowest[0], 0] / wall) >= 0.5
            self._warn_if_slow(*slowest, rates, turned and stepping)
        return out

    def _warn_if_slow(self, worker: int, ratio: float, rates: np.ndarray, turned: bool = True) -> None:
        """One warning per worker, once it was slower than :data:`SLOW_RATIO` of the others twice in a row.

        Only with 3 workers or more: with two, "slower than the others" has
        no majority to say which of them is off (the ratio is still logged).
        """
        for w in list(self._slow_streak):
            if w != worker:
                del self._slow_streak[w]
        if len(rates) < 3 or ratio >= SLOW_RATIO or not turned:
            self._slow_streak.pop(worker, None)
            return
        self._slow_streak[worker] = streak = self._slow_streak.get(worker, 0) + 1
        if streak < SLOW_INTERVALS or worker in self._slow_warned:
            return
        self._slow_warned.add(worker)
        first, last = self.env_ids[worker]
        others = float(np.median(np.delete(rates, worker)))
        print(f"warning: env worker {worker} (envs {first}-{last}) is slow: {rates[worker]:.1f} env steps/s per "
              f"env against a median of {others:.1f} for the other {len(rates) - 1} workers "
              f"({ratio:.2f}x, {SLOW_INTERVALS} intervals in a row; collector/slowest_worker_ratio)",
              file=sys.stderr, flush=True)

    def mark(self) -> None:
        """Start the first timing interval now."""
        self._timing_mark = (time.monotonic(), self.control.timing.copy())
        self._beats_mark = self.control.beats.copy()
