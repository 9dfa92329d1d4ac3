"""Replacing a crashed or hung env worker, or a dead inference server, within a budget.

A long run meets envs that crash (an exception in ``step``/``reset``, a
segfault, a SIGKILL, a hang past ``step_timeout``: in a step or frozen
anywhere, e.g. a stopped process). Instead of ending the
run, the worker is replaced: the chunks it committed are still delivered,
the one it was filling is dropped, its request slots are reused (request
numbers keep the new worker from taking its predecessor's late answers),
and its envs start again past the last step it took, so the gap in
``env_step`` cuts their trajectories: GAE and n-step returns bootstrap at
the cut and never across it. ``max_restarts`` within ``restart_window``
seconds bounds it per worker; past that, for envs that fail while being
built, or for an env that returned NaN, the run stops with the cause. A
dead inference server is replaced ``server.max_restarts`` times over the
run, with the latest published weights; so is a frozen one (no progress
for ``server.step_timeout`` while requests wait), killed first.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from components.collector.failures import CollectorError, Failure, RestartBudget


class WorkerRestarts:
    """Replaces dead workers (``restarts(worker, cause) -> bool``) and a dead server (:meth:`restart_server`)."""

    def __init__(self, collector: Any, max_restarts: int, window: float, server_restarts: int = 0) -> None:
        self.collector = collector
        self.budget = RestartBudget(max_restarts, window)
        self.max_server_restarts = server_restarts
        self.server_count = 0
        #: ``*_total`` server counters of the servers that died, added to the live one's
        self.server_totals: dict[str, float] = {}

    @property
    def may_relaunch_workers(self) -> bool:
        return self.budget.max_restarts > 0 or self.max_server_restarts > 0

    @property
    def count(self) -> int:
        """Worker restarts after a crash or hang, over the run."""
        return self.budget.count

    def __call__(self, w: int, failure: Failure) -> bool:
        c = self.collector
        nth = self.budget.admit(w, failure)  # raises when fresh envs would fail the same way, or past the budget
        if not c.retire_worker(w):
            return False  # a thread still running: the run ends with the failure
        ids = c.relaunch_worker(w)
        print(f"warning: env worker {w} (envs {ids[0]}-{ids[-1]}) restarted with fresh envs "
              f"({nth}/{self.budget.max_restarts} within {self.budget.window:g} s): {failure.message}", file=sys.stderr,
              flush=True)
        return True

    def restart_server(self, cause: str) -> bool:
        """Replace a dead inference server (see :meth:`GraphRepair.replace_server`) within its budget."""
        c = self.collector
        if self.server_count >= self.max_server_restarts:
            raise CollectorError(f"{cause} (after {self.server_count} restart(s); "
                                 f"server.max_restarts={self.max_server_restarts})")
        started = time.monotonic()
        version, totals = c.replace_server(cause)
        for key, value in totals.items():
            self.server_totals[key] = self.server_totals.get(key, 0) + value
        self.server_count += 1
        print(f"warning: inference server ({c.server.backend}) restarted with the weights of version {version} "
              f"in {time.monotonic() - started:.1f} s ({self.server_count}/{self.max_server_restarts}); "
              f"{c.num_workers} env worker(s) restarted with fresh envs: {cause}", file=sys.stderr, flush=True)
        return True
