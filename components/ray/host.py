"""One env host: a Ray actor running a local collector graph that hands out dense chunks.

The host is the same :class:`~components.collector.collector.AsyncBatchedCollector`
a single machine runs (its envs stepped by a worker thread or worker
processes, the policy evaluated inline by each worker), told to cut batches of
one chunk. So every chunk has the usual batch contract (``env_index``,
``env_step``, ``policy_version`` per transition) and the host keeps its own
watchdogs: a hung env step or a crashed env worker fails the host's next
:meth:`EnvHost.collect` with the local collector's message.

Weights arrive as one object-store reference per update (numpy arrays) and
are published into the host's local arena; the host's workers pick them up
between steps exactly as local workers do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from components.collector.graph import GraphSpec


#: chunk buffers of a host's local collector: one filled while the driver's request for the other travels
LOCAL_CHUNKS = 2


@dataclass(frozen=True)
class HostSpec:
    """What one host runs: its envs (global ids from ``first_env``), chunk size, local graph, timeouts."""

    index: int
    first_env: int
    num_envs: int
    chunk_len: int
    seed: int
    local_workers: str = "thread"
    cpus: int = 1
    interaction_mode: int = 0
    stall_timeout: float | None = 60.0
    step_timeout: float | None = 60.0
    skip_non_finite: bool = False

    @property
    def chunk_frames(self) -> int:
        return self.chunk_len * self.num_envs

    def graph(self) -> GraphSpec:
        """The local graph: inline policy copies; one thread worker, or one process worker per CPU."""
        if self.local_workers == "process":
            per_worker = -(-self.num_envs // max(1, min(self.cpus, self.num_envs)))
        else:
            per_worker = self.num_envs
        return GraphSpec(workers=self.local_workers, server="inline", num_envs=self.num_envs,
                         envs_per_worker=per_worker, chunk_len=self.chunk_len, splits=1,
                         chunks_per_worker=LOCAL_CHUNKS)


def numpy_weights(state: Any) -> dict[str, np.ndarray]:
    """A state dict as plain numpy arrays (what goes into the object store once per update)."""
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


class EnvHost:
    """The actor's behaviour; :func:`remote_host_class` makes the Ray actor class of it (so this module needs no Ray)."""

    def __init__(self, spec: HostSpec, env_factory: Any, model_spec: Any, env_spec: Any, server_config: Any,
                 weights: dict[str, np.ndarray], version: int) -> None:
        import torch  # noqa: F401 - loaded before pin_pools, so its intra-op pool is sized there

        from components.collector.collector import AsyncBatchedCollector
        from components.threads import pin_pools, report_pools

        # One host per CPU, each stepping its envs and running its policy copy in turn: one thread each.
        # Ray starts the actor's process with OMP_NUM_THREADS=num_cpus (which OpenBLAS also reads);
        # threadpoolctl re-sizes whatever loaded with another size.
        pin_pools(1)
        self.spec = spec
        self.collector = AsyncBatchedCollector(
            env_factory, model_spec, spec.graph(), frames_per_batch=spec.chunk_frames, total_frames=-1,
            seed=spec.seed, server_config=server_config, interaction_mode=spec.interaction_mode, env_spec=env_spec,
            policy_version=version, stall_timeout=spec.stall_timeout, step_timeout=spec.step_timeout,
            skip_non_finite=spec.skip_non_finite, nest_trees=False,
        )
        self._pause: Any = None
        self.set_weights(weights, version)
        self.collector.start()
        self._seq = 0
        report_pools("ray-host")

    def where(self) -> dict[str, Any]:
        """Which node and process this host runs in (for the plan, metric keys and error lines)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def collect(self) -> tuple[int, dict[str, np.ndarray], dict[str, float]]:
        """The next chunk: (sequence number, flat numpy fields with global env ids, the host's statistics)."""
        batch = self.collector.next_batch()
        fields = {key: value.numpy() for key, value in batch.flatten_keys(".").items()}
        fields["env_index"] = fields["env_index"] + self.spec.first_env
        stats = {f"server/{k}": float(v) for k, v in self.collector.server_stats(reset=True).items()}
        stats.update({f"worker/{k}": float(v) for k, v in self.collector.worker_stats().items()
                      if isinstance(v, (int, float))})
        self._seq += 1
        return self._seq, fields, stats

    def set_weights(self, weights: dict[str, np.ndarray], version: int) -> int:
        import torch

        # copies: the object store hands out read-only views
        return self.collector.update_policy_weights_({k: torch.from_numpy(np.array(v)) for k, v in weights.items()},
                                                     version=int(version))

    def pause(self, timeout: float) -> None:
        """Park the host's workers at their next step boundary (until :meth:`resume`)."""
        if self._pause is None:
            pause = self.collector.pause(timeout)
            pause.__enter__()
            self._pause = pause

    def resume(self) -> None:
        pause, self._pause = self._pause, None
        if pause is not None:
            pause.__exit__(None, None, None)


#: the actor's second thread: weights and pauses never wait behind a ``collect`` that waits for frames
CONTROL_GROUP = "control"


def remote_host_class(ray: Any) -> Any:
    """:class:`EnvHost` as a Ray actor class with two threads.

    ``collect`` (and ``where``) run one at a time on the default
    thread; ``set_weights``, ``pause`` and ``resume`` on a control thread,
    so new weights reach the host's workers at once, not after the chunk
    requests queued before them. (The local collector takes weights and
    pauses from another thread by design.)
    """
    control = ray.method(concurrency_group=CONTROL_GROUP)

    class EnvHost(_EnvHost):  # the same name: it is the actor's process title (ray::EnvHost)
        @control
        def set_weights(self, weights: dict[str, np.ndarray], version: int) -> int:
            return super().set_weights(weights, version)

        @control
        def pause(self, timeout: float) -> None:
            super().pause(timeout)

        @control
        def resume(self) -> None:
            super().resume()

    return ray.remote(concurrency_groups={CONTROL_GROUP: 1})(EnvHost)


_EnvHost = EnvHost
