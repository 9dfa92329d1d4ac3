"""What every collector does once it can cut exact batches: budget, hooks, iteration, the replay writer.

:class:`~components.collector.collector.AsyncBatchedCollector` (workers on
this machine) and :class:`~components.ray.collector.RayCollector` (env hosts
on a Ray cluster) differ only in where transitions come from; both give the
runner the same batch contract, the same stopping rule and the same
background replay writer, from here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from components.collector.assembly import TrajectoryAssembler
from components.collector.writer import ReplayWriter


class BatchStream:
    """Batches of ``frames_per_batch`` transitions until ``total_frames`` (-1: never), from :meth:`next_batch`.

    Subclasses implement :meth:`start`, :meth:`shutdown` and
    :meth:`next_batch` (which advances :attr:`frames`).
    """

    def __init__(self, *, frames_per_batch: int, total_frames: int, initial_frames: int,
                 replay_buffer: Any, postproc: Callable[[Any], Any] | None, on_batch: Callable[[Any], None] | None,
                 yield_completed_trajectories: bool, post_collect_hook: Callable[[Any], None] | None,
                 writer_affinity: list[int] | None) -> None:
        if frames_per_batch < 1:
            raise ValueError(f"frames_per_batch must be >= 1, got {frames_per_batch}")
        if total_frames < -1 or total_frames == 0:
            raise ValueError(f"total_frames must be positive or -1 (endless), got {total_frames}")
        self.frames_per_batch = frames_per_batch
        self.total_frames = total_frames
        self.replay_buffer = replay_buffer
        self.post_collect_hook = post_collect_hook
        self._trajectories = TrajectoryAssembler(frames_per_batch) if yield_completed_trajectories else None
        self._writer = ReplayWriter(replay_buffer, postproc, on_batch, writer_affinity)
        self._frames = int(initial_frames)  # a resumed run counts on from its checkpoint
        self._started = self._closed = False
        self._iter_lock = threading.Lock()

    # ------------------------------------------------------------ subclasses
    def start(self) -> Any:
        raise NotImplementedError

    def shutdown(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

    def next_batch(self, frames: int | None = None) -> Any:
        raise NotImplementedError

    # ----------------------------------------------------------------- common
    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown(timeout=1.0)

    @property
    def frames(self) -> int:
        """Frames collected so far."""
        return self._frames

    @property
    def writing(self) -> bool:
        """Whether the replay writer is still collecting."""
        return self._writer.alive

    @property
    def closed(self) -> bool:
        return self._closed

    def set_on_batch(self, on_batch: Callable[[Any], None] | None) -> None:
        """What the replay writer calls after each write (before :meth:`start`)."""
        self._writer.on_batch = on_batch

    def check_writer(self) -> None:
        """Raise the replay writer's error, if it stopped with one."""
        self._writer.check()

    def _batches(self) -> Iterator[Any]:
        """Batches (or trajectory groups) until ``total_frames``, each shown to the hook."""
        while self.total_frames < 0 or self._frames < self.total_frames:
            left = self.frames_per_batch if self.total_frames < 0 else self.total_frames - self._frames
            batch = self.next_batch(min(self.frames_per_batch, left))
            if self._trajectories is not None:
                batch = self._trajectories.add(batch)
                if batch is None:
                    continue
            if self.post_collect_hook is not None:
                self.post_collect_hook(batch)
            yield batch

    def __iter__(self) -> Iterator[Any]:
        if self.replay_buffer is not None:
            raise RuntimeError("this collector writes to its replay buffer; sample the buffer instead of iterating")
        if not self._iter_lock.acquire(blocking=False):
            raise RuntimeError("the collector is already being iterated")
        try:
            self.start()
            yield from self._batches()
        finally:
            self._iter_lock.release()
