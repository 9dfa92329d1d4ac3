"""Replacing a crashed or hung env worker with fresh envs, within a budget.

A long run meets envs that crash (an exception in ``step``/``reset``, a
segfault, a SIGKILL, a hang past ``step_timeout``). Instead of ending the
run, the worker is replaced: the chunks it committed are still delivered,
the one it was filling is dropped, its request slots are reused (request
numbers keep the new worker from taking its predecessor's late answers),
and its envs start again past the last step it took, so the gap in
``env_step`` cuts their trajectories: GAE and n-step returns bootstrap at
the cut and never across it. ``max_restarts`` within ``restart_window``
seconds bounds it per worker; past that, for envs that fail while being
built, or for an env that returned NaN, the run stops with the cause.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from components.collector.monitor import CollectorError
from components.collector.pools import WorkerAssignment
from components.collector.worker import BUILDING, STARTING, TIMING
from components.envs import env_seeds


class WorkerRestarts:
    """Called by the monitor as ``restarts(worker, cause) -> bool`` when a worker is down."""

    def __init__(self, collector: Any, max_restarts: int, window: float) -> None:
        self.collector, self.max_restarts, self.window = collector, max_restarts, window
        self.count = 0
        self._times: dict[int, list[float]] = {}

    def __call__(self, w: int, cause: str) -> bool:
        c = self.collector
        now = time.monotonic()
        recent = [t for t in self._times.get(w, []) if now - t < self.window]
        if "could not build its envs" in cause or "returned a non-finite" in cause:
            return False  # fresh envs would fail the same way; a NaN is a bug to see, not to retry
        if len(recent) >= self.max_restarts:
            raise CollectorError(f"{cause} (after {len(recent)} restart(s) within {self.window:g} s; "
                                 f"workers.max_restarts={self.max_restarts})")
        if not c.workers.retire(w):
            return False
        c._pool.reclaim(w)
        control = c._control
        first_step = int(control.timing[w, TIMING.index("steps")]) + 2  # past every step it took: a gap
        control.status[w], control.paused[w], control.activity[w], control.heartbeat[w] = STARTING, 0, BUILDING, now
        self.count += 1
        first = sum(c._rows[:w])
        ids = tuple(range(first, first + c._rows[w]))
        seeds = env_seeds(c._seed, c.graph.num_envs, restart=self.count)
        affinity = [list(a) for a in c.graph.worker_affinity] if c.graph.worker_affinity else None
        c.workers.launch(
            WorkerAssignment(w, ids, tuple(seeds[i] for i in ids), c._splits[w], first_step), c.env_factory,
            [c._slots.client(ch.slot) for ch in c._channels[w]], c._pool.writer(w), control,
            int(c.interaction_mode), c.layout.response_keys, affinity,
        )
        self._times[w] = [*recent, now]
        print(f"warning: env worker {w} (envs {ids[0]}-{ids[-1]}) restarted with fresh envs "
              f"({len(recent) + 1}/{self.max_restarts} within {self.window:g} s): {cause}", file=sys.stderr,
              flush=True)
        return True
