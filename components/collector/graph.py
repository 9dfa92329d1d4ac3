"""Where each part of the collector graph runs, and what its chunk budget allows."""

from __future__ import annotations

import math
from dataclasses import dataclass

from components.kinds import ServerKind, WorkerKind


@dataclass(frozen=True)
class GraphSpec:
    """Where each part of the collector graph runs (``auto`` already resolved).

    Attributes:
        workers: "thread" or "process" (the env backend).
        server: "thread" (in the driver), "process" (a dedicated process) or
            "inline" (a copy of the policy inside every env worker).
        num_envs / envs_per_worker: env count and block size per worker.
        chunk_len: consecutive steps per worker message.
        splits: blocks each worker steps alternately, each with its own
            request (2 = double-buffered sampling: one block steps while the
            server computes the other's actions).
        chunks_per_worker: chunk buffers per worker (None: one batch ahead).
        worker_affinity: CPU sets for process workers, used round-robin.
        worker_nice: niceness increment of process workers (they yield to
            the inference server and the trainer).
        concurrent_envs: every env of a worker steps in its own thread and
            its transition is written as it returns (for envs whose step
            mostly waits); one block per worker, so ``splits`` must be 1.
        worker_threads: BLAS/OpenMP/torch threads of each process worker
            (pinned before it loads numpy: :mod:`components.threads`).

    Examples:
        >>> g = GraphSpec("process", "process", num_envs=7, envs_per_worker=4, chunk_len=3, splits=2)
        >>> g.num_workers, g.worker_rows(), g.split_sizes(3)
        (2, [4, 3], (2, 1))
    """

    workers: str = "thread"
    server: str = "thread"
    num_envs: int = 8
    envs_per_worker: int = 4
    chunk_len: int = 1
    splits: int = 1
    chunks_per_worker: int | None = None
    worker_affinity: tuple[tuple[int, ...], ...] | None = None
    worker_nice: int = 0
    concurrent_envs: bool = False
    worker_threads: int = 1

    def __post_init__(self) -> None:
        WorkerKind.check("workers", self.workers)
        ServerKind.check("server", self.server)
        if min(self.num_envs, self.envs_per_worker, self.chunk_len, self.splits, self.worker_threads) < 1:
            raise ValueError("num_envs, envs_per_worker, chunk_len, splits and worker_threads must be >= 1")
        if self.concurrent_envs and self.splits != 1:
            raise ValueError("concurrent_envs steps every env on its own: splits must be 1")
        if self.chunks_per_worker is not None and self.chunks_per_worker < 1:
            raise ValueError(f"chunks_per_worker must be >= 1 or None, got {self.chunks_per_worker}")

    @property
    def num_workers(self) -> int:
        return math.ceil(self.num_envs / self.envs_per_worker)

    def worker_rows(self) -> list[int]:
        full, rest = divmod(self.num_envs, self.envs_per_worker)
        return [self.envs_per_worker] * full + ([rest] if rest else [])

    def split_sizes(self, rows: int) -> tuple[int, ...]:
        """How a worker of ``rows`` envs divides them into blocks (near-equal, in order)."""
        parts = min(self.splits, rows)
        base, extra = divmod(rows, parts)
        return tuple(base + (1 if i < extra else 0) for i in range(parts))

    def chunks_per_worker_for(self, frames_per_batch: int) -> int:
        """Chunk buffers per worker: as configured, or enough to run one batch ahead."""
        if self.chunks_per_worker is not None:
            return self.chunks_per_worker
        return max(2, math.ceil(frames_per_batch / (self.chunk_len * self.num_envs)) + 1)

    def chunk_budget_problem(self, frames_per_batch: int) -> str | None:
        """Why the chunk buffers cannot hold one batch (None when they can).

        The driver keeps every chunk of a batch until the batch is copied out,
        plus the part of a chunk it carried over from the previous batch: with
        all buffers held and still short of a batch, workers and driver would
        wait for each other forever. Progress needs
        ``buffered frames >= frames_per_batch + largest chunk - 1``.
        """
        per_worker = self.chunks_per_worker_for(frames_per_batch)
        rows = self.worker_rows()
        buffered = per_worker * self.chunk_len * sum(rows)
        largest = self.chunk_len * max(rows)
        needed = frames_per_batch + largest - 1
        if buffered >= needed:
            return None
        fewest = math.ceil(needed / (self.chunk_len * sum(rows)))
        return (f"{per_worker} chunks per worker buffer {buffered} transitions ({self.num_workers} worker(s) x "
                f"{self.chunk_len} steps x their envs), fewer than one batch of {frames_per_batch} plus a carried "
                f"chunk needs ({needed}); use at least {fewest} (or null)")
