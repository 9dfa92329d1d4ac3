"""What a worker and the driver share, and the waits every worker loop makes.

The block loop (:mod:`components.collector.worker`) and the concurrent-env
loop (:mod:`components.collector.env_threads`) both wait here, with the
same bounds: every wait re-checks ``stop`` and beats the progress clock, so
a slow server or consumer keeps a worker waiting, never frozen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from components.collector.chunks import ChunkWriter
from components.collector.failures import Failure, FailureKind
from components.shm import FieldSpec, SharedArena, lane_field, lanes

_WAIT_S = 0.05
_ERROR_BYTES = 4096

# Status codes of the control block.
STARTING, RUNNING, FAILED, EXITED = 0, 1, 2, 3
#: Columns of the per-worker timing table (``rows_requested``: observation
#: rows sent to the server, the worker-side count of what it must serve).
TIMING = ("env_s", "infer_wait_s", "chunk_wait_s", "steps", "frames", "rows_requested", "non_finite_skipped")
#: What a worker is doing now, by code (the ``activity`` column).
ACTIVITIES = ("building its envs", "stepping envs", "waiting for actions from the inference server",
              "waiting for a free chunk (the consumer holds them all)", "paused",
              "waiting for the trainer to ask for the next batch (lockstep)")
BUILDING, STEPPING, WAITING_ACTIONS, WAITING_CHUNK, PAUSED, WAITING_TURN = range(len(ACTIVITIES))


class ActionChannel(Protocol):
    """How a worker gets actions: write ``request``, ``submit``, ``wait``."""

    request: dict[str, np.ndarray]

    def submit(self, rows: int | None = None, mode: int | None = None) -> None: ...  # acts on ``request``

    def wait(self, timeout: float | None = None) -> dict[str, np.ndarray]: ...


class WorkerControl:
    """Shared flags and counters between the driver and its workers."""

    def __init__(self, num_workers: int) -> None:
        # Fields a worker writes every step are lanes (components.shm.lane_field): no two workers share a line.
        self._arena = SharedArena([
            # Per worker: all set to stop the graph, one to retire a worker (a server restart).
            FieldSpec("stop", (num_workers,), "int8"),
            FieldSpec("pause", (1,), "int8"),
            FieldSpec("paused", (num_workers,), "int8"),
            FieldSpec("status", (num_workers,), "int8"),
            FieldSpec("error", (num_workers, _ERROR_BYTES), "uint8"),
            FieldSpec("failure_kind", (num_workers,), "int8"),
            lane_field("timing", num_workers, "float64", len(TIMING)),
            lane_field("activity", num_workers, "int8"),
            # when the env step in progress began (the step watchdog's clock)
            lane_field("heartbeat", num_workers, "float64"),
            # when the worker last turned its loop, and how many turns it took (the progress watchdog's)
            lane_field("progress", num_workers, "float64"),
            lane_field("beats", num_workers, "int64"),
            FieldSpec("reset_epoch", (1,), "int64"),
            # lockstep collection: env steps (turns of a worker's loop) the driver has asked for so far; -1: no limit
            FieldSpec("granted", (1,), "int64"),
        ])
        self._bind()
        self.granted[0] = -1

    def _bind(self) -> None:
        a = self._arena
        self.stop, self.pause, self.paused = a.array("stop"), a.array("pause"), a.array("paused")
        self.status, self.timing = a.array("status"), lanes(a.array("timing"), len(TIMING))
        self.activity, self.heartbeat = lanes(a.array("activity")), lanes(a.array("heartbeat"))
        self.progress, self.beats = lanes(a.array("progress")), lanes(a.array("beats"))
        self.reset_epoch = a.array("reset_epoch")
        self.granted = a.array("granted")

    def __getstate__(self) -> dict[str, Any]:
        return {"_arena": self._arena}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def beat(self, worker: int) -> None:
        """Worker ``worker`` turned its loop: it is alive and not stuck (a few hundred ns)."""
        self.progress[worker] = time.monotonic()
        self.beats[worker] += 1

    def fail(self, worker: int, message: str, kind: FailureKind = FailureKind.CRASH) -> None:
        data = message.encode("utf-8", "replace")[: _ERROR_BYTES - 1]
        err = self._arena.array("error")
        err[worker, :] = 0
        err[worker, : len(data)] = np.frombuffer(data, np.uint8)
        self._arena.array("failure_kind")[worker] = int(kind)
        self.status[worker] = FAILED

    def failure(self, worker: int) -> Failure:
        """What worker ``worker`` said when it failed, and of which kind."""
        raw = bytes(self._arena.array("error")[worker])
        return Failure(raw.split(b"\0", 1)[0].decode("utf-8", "replace"),
                       FailureKind(int(self._arena.array("failure_kind")[worker])))


class Stopped(Exception):
    """The driver set ``stop`` while this worker waited: it ends without an error."""


def park(worker: int, control: WorkerControl) -> None:
    control.activity[worker] = PAUSED
    control.paused[worker] = 1
    while control.pause[0] and not control.stop[worker]:
        control.beat(worker)  # parked, not frozen
        time.sleep(0.005)
    control.paused[worker] = 0
    control.heartbeat[worker] = time.monotonic()
    control.beat(worker)


def acquire_chunk(worker: int, chunks: ChunkWriter, control: WorkerControl) -> dict[str, np.ndarray] | None:
    """The next free chunk, or None within a bounded wait (the caller re-checks stop and pause); timed."""
    control.activity[worker] = WAITING_CHUNK
    started = time.perf_counter()
    chunk = chunks.acquire(_WAIT_S)
    control.timing[worker, 2] += time.perf_counter() - started
    return chunk


def await_response(channel: ActionChannel, stop: np.ndarray, beat: Callable[[], None] | None = None) -> dict[str, np.ndarray]:
    """The response to the channel's request, in bounded turns: each one re-checks stop and beats.

    A slow server keeps the worker waiting here, never frozen: ``beat``
    (the worker's progress clock) advances every turn.
    """
    while True:
        try:
            return channel.wait(_WAIT_S * 5)
        except TimeoutError:
            if stop[0]:
                raise Stopped() from None
            if beat is not None:
                beat()


