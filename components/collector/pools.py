"""Env worker backends: the same worker loop in threads or in spawned processes."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from components.collector.chunks import ChunkWriter
from components.collector.worker import run_worker
from components.collector.worker_control import WorkerControl
from components.collector.env_block import EnvBlock
from components.lifecycle import become_child, force_stop, on_main_thread, set_affinity, start_immune
from components.portable import portable
from components.threads import child_pools, pin_pools


@dataclass(frozen=True)
class WorkerAssignment:
    """Which envs a worker hosts, how they are seeded and split into blocks.

    ``split_sizes`` divides the worker's envs, in order, into the blocks it
    steps alternately (one request channel each).
    """

    worker: int
    env_ids: tuple[int, ...]
    seeds: tuple[int, ...]
    split_sizes: tuple[int, ...]
    first_step: int = 0
    #: ``trainer.nan_policy=skip``: cut a non-finite step out instead of failing
    skip_non_finite: bool = False
    #: ``workers.concurrent_envs``: every env in its own thread, stepping at once (one block per env)
    concurrent: bool = False


class _BlockMaker:
    """Picklable ``() -> list[EnvBlock]`` (a lambda would not survive spawn)."""

    def __init__(self, factory: Callable[[], Any], assignment: WorkerAssignment) -> None:
        self.factory, self.assignment = factory, assignment

    def __call__(self) -> list[EnvBlock]:
        a, blocks, first = self.assignment, [], 0
        sizes = (1,) * len(a.env_ids) if a.concurrent else a.split_sizes
        try:
            for size in sizes:
                ids = slice(first, first + size)
                blocks.append(EnvBlock(self.factory, a.env_ids[ids], a.seeds[ids], a.first_step,
                                       skip_non_finite=a.skip_non_finite))
                first += size
        except BaseException:
            for block in blocks:
                block.close()
            raise
        return blocks


def _process_main(
    assignment: WorkerAssignment,
    factory: Callable[[], Any],
    channels: list[Any],
    writer: ChunkWriter,
    control: WorkerControl,
    mode: int,
    response_keys: tuple[str, ...],
    affinity: list[int] | None,
    nice: int,
    parent_pid: int,
    from_main_thread: bool,
    threads: int = 1,
) -> None:
    become_child(parent_pid, from_main_thread)
    pin_pools(threads)
    set_affinity(affinity)
    if nice:
        # Below the inference server: when a request arrives the server
        # preempts a stepping worker at once instead of waiting for its turn.
        os.nice(nice)
    try:
        run_worker(assignment.worker, _BlockMaker(factory, assignment), channels, writer, control, mode, response_keys,
                   assignment.concurrent)
    except BaseException:  # noqa: BLE001 - already reported through control
        os._exit(1)


class ThreadWorkers:
    """Workers as daemon threads of the driver (cheap to start, share the GIL)."""

    backend = "thread"

    def __init__(self, affinity: list[int] | None = None) -> None:
        self._threads: list[threading.Thread] = []
        self._affinity = affinity  # the driver's CPU mask for its own threads

    def start(self, assignments: Sequence[WorkerAssignment], factory: Callable[[], Any],
              channels: Sequence[list[Any]], writers: Sequence[ChunkWriter], control: WorkerControl,
              mode: int, response_keys: tuple[str, ...], affinity: Sequence[list[int]] | None = None) -> None:
        for a, worker_channels, writer in zip(assignments, channels, writers):
            self.launch(a, factory, worker_channels, writer, control, mode, response_keys, affinity)

    def launch(self, a: WorkerAssignment, factory: Callable[[], Any], channels: list[Any], writer: ChunkWriter,
               control: WorkerControl, mode: int, response_keys: tuple[str, ...],
               affinity: Sequence[list[int]] | None = None) -> None:
        """Start worker ``a.worker`` (again, after :meth:`retire`, to replace a crashed one)."""
        thread = threading.Thread(
            target=self._run,
            args=(self._affinity, a.worker, _BlockMaker(factory, a), channels, writer, control, mode, response_keys,
                  a.concurrent),
            name=f"env-worker-{a.worker}",
            daemon=True,
        )
        thread.start()
        if a.worker < len(self._threads):
            self._threads[a.worker] = thread
        else:
            self._threads.append(thread)

    def retire(self, worker: int) -> bool:
        """Make sure worker ``worker`` is gone; False if it cannot be (a thread still running)."""
        self._threads[worker].join(1.0)
        return not self._threads[worker].is_alive()

    @staticmethod
    def _run(affinity: list[int] | None, *args: Any) -> None:
        set_affinity(affinity)
        try:
            run_worker(*args)
        except BaseException:  # noqa: BLE001 - reported through control; the driver raises
            pass

    def alive(self, worker: int) -> bool:
        return self._threads[worker].is_alive()

    def exit_description(self, worker: int) -> str:
        return "its thread ended"

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def any_alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def __len__(self) -> int:
        return len(self._threads)


class ProcessWorkers:
    """Workers as spawned processes that import only numpy and the env stack."""

    backend = "process"

    def __init__(self, ctx: Any, nice: int = 0, threads: int = 1) -> None:
        self._ctx = ctx
        self._nice = nice
        #: BLAS/OpenMP/torch threads of each worker process (see components.threads)
        self.threads = int(threads)
        self._processes: list[Any] = []

    def start(self, assignments: Sequence[WorkerAssignment], factory: Callable[[], Any],
              channels: Sequence[list[Any]], writers: Sequence[ChunkWriter], control: WorkerControl,
              mode: int, response_keys: tuple[str, ...], affinity: Sequence[list[int]] | None = None) -> None:
        for a, worker_channels, writer in zip(assignments, channels, writers):
            self.launch(a, factory, worker_channels, writer, control, mode, response_keys, affinity)

    def launch(self, a: WorkerAssignment, factory: Callable[[], Any], channels: list[Any], writer: ChunkWriter,
               control: WorkerControl, mode: int, response_keys: tuple[str, ...],
               affinity: Sequence[list[int]] | None = None) -> None:
        """Start worker ``a.worker`` (again, after :meth:`retire`, to replace a crashed one)."""
        cpus = list(affinity[a.worker % len(affinity)]) if affinity else None
        process = self._ctx.Process(
            target=_process_main,
            args=(a, portable(factory), channels, writer, control, mode, response_keys, cpus, self._nice,
                  os.getpid(), on_main_thread(), self.threads),
            name=f"env-worker-{a.worker}",
            daemon=True,
        )
        with child_pools(self.threads):
            start_immune(process)
        if a.worker < len(self._processes):
            self._processes[a.worker] = process
        else:
            self._processes.append(process)

    def retire(self, worker: int) -> bool:
        """Make sure worker ``worker`` is gone (killed if it still runs); always possible."""
        self.kill(worker)
        return True

    def alive(self, worker: int) -> bool:
        return self._processes[worker].is_alive()

    def exit_description(self, worker: int) -> str:
        code = self._processes[worker].exitcode
        return f"its process exited with code {code}" if code is not None else "its process is running"

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            force_stop(process)

    def any_alive(self) -> bool:
        return any(p.is_alive() for p in self._processes)

    def kill(self, worker: int) -> None:
        """SIGKILL worker ``worker`` (a hung env step does not answer anything gentler)."""
        process = self._processes[worker]
        if process.is_alive():
            process.kill()
            process.join(5.0)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def __len__(self) -> int:
        return len(self._processes)
