"""The collector's own repair steps: relaunching one env worker, replacing the inference server.

:class:`GraphRepair` is a mixin of
:class:`~components.collector.collector.AsyncBatchedCollector`: these are the
collector's public methods, kept in their own module to keep the collector's
short. Whether and how often to repair is decided elsewhere
(:mod:`components.collector.restarts`, with a
:class:`~components.collector.failures.RestartBudget`); here is only how.
"""

from __future__ import annotations

import time
from typing import Any

from components.collector.failures import CollectorError
from components.collector.pools import WorkerAssignment
from components.collector.worker_control import BUILDING, STARTING, TIMING
from components.envs import env_seeds
from components.inference.server import ServerError
from components.lifecycle import release_semaphore_names


class GraphRepair:
    """Relaunch a worker on fresh envs past its last step; replace a dead server and every worker."""

    _launches = 0  # every relaunch draws new env seeds

    def retire_worker(self, w: int) -> bool:
        """Make sure worker ``w`` is gone (False: a thread still running, which nothing can stop)."""
        c: Any = self
        return bool(c.workers.retire(w))

    def relaunch_worker(self, w: int) -> tuple[int, ...]:
        """Start worker ``w`` again on fresh envs, past every step its predecessor took; its env ids.

        The chunks it committed are still delivered, the one it was filling
        is dropped and its request slots are reused (request numbers keep it
        from taking its predecessor's late answers); the gap in ``env_step``
        cuts its envs' trajectories.
        """
        c: Any = self
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

    def replace_server(self, cause: str) -> tuple[int, dict[str, float]]:
        """Replace the dead server, serving the latest published weights, and relaunch every worker.

        The workers lost their server with it (their liveness pipe closed),
        so all of them start again on fresh envs, their trajectories cut as
        after a crash; a new transport and weights channel replace the old
        ones, so nothing the dead server may have held locked is used again.
        Returns the version served and the dead server's ``*_total`` counters.
        """
        c: Any = self
        with c._server_lock:
            old = c.server
            state, version, seq = old.weights_channel.snapshot(timeout=1.0)
            if seq == 0:
                version = old.policy_version
            # a dead server answers with the snapshot of its last read, whose *_total counters outlive it
            totals = {k: v for k, v in old.stats(reset=False).items() if k.endswith("_total")}
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
            for w in range(len(c._rows)):
                self.relaunch_worker(w)
            c._release_names(pool=False)  # the new transport's and weights channel's names only
        return int(version), totals
