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
from components.collector.pools import WorkerAssignment
from components.collector.worker_control import BUILDING, STARTING, TIMING
from components.envs import env_seeds
from components.inference.server import ServerError
from components.lifecycle import release_semaphore_names


class WorkerRestarts:
    """Replaces dead workers (``restarts(worker, cause) -> bool``) and a dead server (:meth:`restart_server`)."""

    def __init__(self, collector: Any, max_restarts: int, window: float, server_restarts: int = 0) -> None:
        self.collector, self.max_restarts = collector, max_restarts
        self.budget = RestartBudget(max_restarts, window)
        self.max_server_restarts = server_restarts
        self.server_count = 0
        #: ``*_total`` server counters of the servers that died, added to the live one's
        self.server_totals: dict[str, float] = {}
        self._launches = 0  # every relaunch draws new env seeds

    @property
    def may_relaunch_workers(self) -> bool:
        return self.max_restarts > 0 or self.max_server_restarts > 0

    @property
    def count(self) -> int:
        """Worker restarts after a crash or hang, over the run."""
        return self.budget.count

    def __call__(self, w: int, failure: Failure) -> bool:
        nth = self.budget.admit(w, failure)  # raises when fresh envs would fail the same way, or past the budget
        if not self.collector.workers.retire(w):
            return False  # a thread still running: the run ends with the failure
        ids = self._relaunch(w)
        print(f"warning: env worker {w} (envs {ids[0]}-{ids[-1]}) restarted with fresh envs "
              f"({nth}/{self.max_restarts} within {self.budget.window:g} s): {failure.message}", file=sys.stderr,
              flush=True)
        return True

    def _relaunch(self, w: int) -> tuple[int, ...]:
        """Start worker ``w`` again on fresh envs, past every step its predecessor took."""
        c = self.collector
        c._pool.reclaim(w)
        control = c._control
        # Past every step it took, leaving a gap. Concurrent envs step at their own pace: no env of the
        # worker took more steps than the worker wrote transitions.
        taken = TIMING.index("frames" if c.graph.concurrent_envs else "steps")
        first_step = int(control.timing[w, taken]) + 2
        control.status[w], control.paused[w], control.activity[w] = STARTING, 0, BUILDING
        control.heartbeat[w] = time.monotonic()
        control.beat(w)
        self._launches += 1
        first = sum(c._rows[:w])
        ids = tuple(range(first, first + c._rows[w]))
        seeds = env_seeds(c._seed, c.graph.num_envs, restart=self._launches)
        affinity = [list(a) for a in c.graph.worker_affinity] if c.graph.worker_affinity else None
        c.workers.launch(
            WorkerAssignment(w, ids, tuple(seeds[i] for i in ids), c._splits[w], first_step, c.skip_non_finite,
                             c.graph.concurrent_envs),
            c.env_factory, c._worker_channels(w), c._pool.writer(w), control,
            int(c.interaction_mode), c.layout.response_keys, affinity,
        )
        return ids

    def restart_server(self, cause: str) -> bool:
        """Replace a dead inference server, serving the latest published weights, and every worker.

        The workers lost their server with it (their liveness pipe closed),
        so all of them start again on fresh envs, their trajectories cut as
        after a crash; a new transport and weights channel replace the old
        ones, so nothing the dead server may have held locked is used again.
        """
        c = self.collector
        if self.server_count >= self.max_server_restarts:
            raise CollectorError(f"{cause} (after {self.server_count} restart(s); "
                                 f"server.max_restarts={self.max_server_restarts})")
        started = time.monotonic()
        with c._server_lock:
            old = c.server
            state, version, seq = old.weights_channel.snapshot(timeout=1.0)
            if seq == 0:
                version = old.policy_version
            for key, value in (old._last_stats or {}).items():
                if key.endswith("_total"):
                    self.server_totals[key] = self.server_totals.get(key, 0) + value
            c._control.stop[:] = 1  # a worker waiting for a free chunk would not notice the server's death
            for w in range(len(c._rows)):
                if not c.workers.retire(w):
                    raise CollectorError(f"{cause}; env worker {w} did not stop for the server restart")
            c._control.stop[:] = 0
            old.shutdown(timeout=1.0)
            if not c._names_released:  # never opened again (dropped already when nothing may relaunch)
                release_semaphore_names(c._slots, old.weights_channel)
            slots, server, channels = c._server_side(version)
            if seq:
                server.update_weights(state, version)
            try:
                server.start()
            except ServerError as err:
                raise CollectorError(f"{cause}; restarting it failed: {err}") from None
            c._slots, c.server, c._channels = slots, server, channels
            c._monitor.server = server
            self.server_count += 1
            for w in range(len(c._rows)):
                self._relaunch(w)
            c._release_names(pool=False)  # the new transport's and weights channel's names only
        print(f"warning: inference server ({server.backend}) restarted with the weights of version {version} "
              f"in {time.monotonic() - started:.1f} s ({self.server_count}/{self.max_server_restarts}); "
              f"{len(c._rows)} env worker(s) restarted with fresh envs: {cause}", file=sys.stderr, flush=True)
        return True
