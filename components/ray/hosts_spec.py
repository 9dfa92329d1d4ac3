"""How env hosts are laid out: how many, which envs each holds, chunk size, placement and backpressure.

Plain data the plan (:mod:`pipeline.plan.ray`) fills and the collector
reads; importing it needs no Ray.
"""

from __future__ import annotations

from collections.abc import Mapping

from components.kinds import RayScheduling, WorkerKind


def split_envs(num_envs: int, num_hosts: int) -> list[int]:
    """Near-equal env counts per host, larger first.

    Examples:
        >>> split_envs(10, 4)
        [3, 3, 2, 2]
    """
    base, extra = divmod(num_envs, num_hosts)
    return [base + (1 if i < extra else 0) for i in range(num_hosts)]


class RayHostsSpec:
    """How many hosts, which envs each holds, chunk size, placement and backpressure."""

    def __init__(self, num_envs: int, num_hosts: int, chunk_len: int, *, in_flight: int = 2,
                 cpus_per_host: float = 1.0, resources: Mapping[str, float] | None = None,
                 scheduling: str = "SPREAD", local_workers: str = "thread", start_timeout: float = 120.0) -> None:
        if num_hosts < 1 or num_hosts > num_envs:
            raise ValueError(f"the number of env hosts must be in [1, num_envs={num_envs}], got {num_hosts}")
        if chunk_len < 1 or in_flight < 1:
            raise ValueError("chunk_len and in_flight must be >= 1")
        local_workers = WorkerKind.check("local_workers", local_workers)
        scheduling = RayScheduling.check("scheduling", scheduling)
        self.num_envs, self.num_hosts, self.chunk_len = num_envs, num_hosts, chunk_len
        self.in_flight, self.cpus_per_host = in_flight, float(cpus_per_host)
        self.resources = dict(resources or {})
        self.scheduling, self.local_workers, self.start_timeout = scheduling, local_workers, float(start_timeout)
        self.rows = split_envs(num_envs, num_hosts)

    def first_envs(self) -> list[int]:
        return [sum(self.rows[:i]) for i in range(self.num_hosts)]

    def chunk_frames(self) -> list[int]:
        return [self.chunk_len * r for r in self.rows]
