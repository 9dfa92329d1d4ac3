"""The env worker loop, identical in a thread and in a process.

    actions arrive -> record what was acted on into the chunk row
    -> step the envs (transition written into the chunk row) -> request the
    next actions -> (next split while the server works) -> full chunk?
    commit, take the next free one

Every blocking wait is bounded so a worker always notices stop and pause
requests. Time is split into env stepping, waiting for actions and waiting
for a free chunk, which tells an env-bound run from an inference-bound or a
trainer-bound one. Each worker also publishes what it is doing now
(:data:`ACTIVITIES`) and when it last made progress, so a driver that waits
in vain can say which worker waits on what.

Two clocks per worker, both in the shared control block: ``heartbeat`` is
when the env step in progress began (the step watchdog's clock: one step
that never returns), ``progress`` (with the ``beats`` counter) is when the
worker last turned its loop. Since every wait is a bounded turn, a live
worker beats every fraction of a second whatever it waits on (a slow
server, a trainer that holds every chunk); only a worker that is frozen
(deadlocked outside an env step, or a process the kernel stopped) stops
beating, and the driver treats that as a hang wherever it is stuck.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from components.collector.chunks import ChunkWriter
from components.collector.env_block import NEXT_KEYS, EnvBlock
from components.procname import set_name
from components.threads import report_pools
from components.shm import FieldSpec, SharedArena

_WAIT_S = 0.05
_ERROR_BYTES = 4096

# Status codes of the control block.
STARTING, RUNNING, FAILED, EXITED = 0, 1, 2, 3
#: Columns of the per-worker timing table (``rows_requested``: observation
#: rows sent to the server, the worker-side count of what it must serve).
TIMING = ("env_s", "infer_wait_s", "chunk_wait_s", "steps", "frames", "rows_requested", "non_finite_skipped")
#: What a worker is doing now, by code (the ``activity`` column).
ACTIVITIES = ("building its envs", "stepping envs", "waiting for actions from the inference server",
              "waiting for a free chunk (the consumer holds them all)", "paused")
BUILDING, STEPPING, WAITING_ACTIONS, WAITING_CHUNK, PAUSED = range(len(ACTIVITIES))


class ActionChannel(Protocol):
    """How a worker gets actions: write ``request``, ``submit``, ``wait``."""

    request: dict[str, np.ndarray]

    def submit(self, rows: int | None = None, mode: int | None = None) -> None: ...  # acts on ``request``

    def wait(self, timeout: float | None = None) -> dict[str, np.ndarray]: ...


class WorkerControl:
    """Shared flags and counters between the driver and its workers."""

    def __init__(self, num_workers: int) -> None:
        self._arena = SharedArena([
            # Per worker: all set to stop the graph, one to retire a worker (a server restart).
            FieldSpec("stop", (num_workers,), "int8"),
            FieldSpec("pause", (1,), "int8"),
            FieldSpec("paused", (num_workers,), "int8"),
            FieldSpec("status", (num_workers,), "int8"),
            FieldSpec("error", (num_workers, _ERROR_BYTES), "uint8"),
            FieldSpec("timing", (num_workers, len(TIMING)), "float64"),
            FieldSpec("activity", (num_workers,), "int8"),
            # when the env step in progress began (the step watchdog's clock)
            FieldSpec("heartbeat", (num_workers,), "float64"),
            # when the worker last turned its loop, and how many turns it took (the progress watchdog's)
            FieldSpec("progress", (num_workers,), "float64"),
            FieldSpec("beats", (num_workers,), "int64"),
            FieldSpec("reset_epoch", (1,), "int64"),
        ])
        self._bind()

    def _bind(self) -> None:
        a = self._arena
        self.stop, self.pause, self.paused = a.array("stop"), a.array("pause"), a.array("paused")
        self.status, self.timing = a.array("status"), a.array("timing")
        self.activity, self.heartbeat = a.array("activity"), a.array("heartbeat")
        self.progress, self.beats = a.array("progress"), a.array("beats")
        self.reset_epoch = a.array("reset_epoch")

    def __getstate__(self) -> dict[str, Any]:
        return {"_arena": self._arena}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def beat(self, worker: int) -> None:
        """Worker ``worker`` turned its loop: it is alive and not stuck (a few hundred ns)."""
        self.progress[worker] = time.monotonic()
        self.beats[worker] += 1

    def fail(self, worker: int, message: str) -> None:
        data = message.encode("utf-8", "replace")[: _ERROR_BYTES - 1]
        err = self._arena.array("error")
        err[worker, :] = 0
        err[worker, : len(data)] = np.frombuffer(data, np.uint8)
        self.status[worker] = FAILED

    def error(self, worker: int) -> str:
        raw = bytes(self._arena.array("error")[worker])
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class _Stopped(Exception):
    pass


def _park(worker: int, control: WorkerControl) -> None:
    control.activity[worker] = PAUSED
    control.paused[worker] = 1
    while control.pause[0] and not control.stop[worker]:
        control.beat(worker)  # parked, not frozen
        time.sleep(0.005)
    control.paused[worker] = 0
    control.heartbeat[worker] = time.monotonic()
    control.beat(worker)


def run_worker(
    worker: int,
    make_blocks: Callable[[], list[EnvBlock]],
    channels: list[ActionChannel],
    chunks: ChunkWriter,
    control: WorkerControl,
    interaction_mode: int,
    response_keys: tuple[str, ...],
    concurrent: bool = False,
) -> None:
    """Run until ``control.stop``; report failures through ``control``.

    ``make_blocks`` builds the worker's env blocks, one per channel: with two
    (double-buffered sampling) one block steps while the server computes the
    other's actions, so the worker rarely waits for inference. With
    ``concurrent`` the blocks hold one env each and step at once, in threads,
    sharing the one channel (:mod:`components.collector.env_threads`).
    """
    set_name(f"env-worker-{worker}")  # in a process worker's main thread: the process, as ps shows it
    control.activity[worker] = BUILDING
    control.heartbeat[worker] = time.monotonic()
    control.beat(worker)
    try:
        blocks = make_blocks()
    except BaseException as exc:  # noqa: BLE001 - reported, then re-raised to end the worker
        control.fail(worker, f"env worker {worker} could not build its envs: {exc!r}")
        raise
    if multiprocessing.parent_process() is not None:  # a process worker (a thread worker has the driver's pools)
        report_pools(f"env-worker-{worker}")
    try:
        # The first resets count as a step (one that never returns is a hang, as in step).
        control.activity[worker] = STEPPING
        control.heartbeat[worker] = time.monotonic()
        control.beat(worker)
        control.status[worker] = RUNNING
        if concurrent:
            from components.collector.env_threads import run_concurrent

            run_concurrent(worker, blocks, channels[0], chunks, control, interaction_mode, response_keys)
        else:
            _loop(worker, blocks, channels, chunks, control, interaction_mode, response_keys)
        control.status[worker] = EXITED
    except _Stopped:
        control.status[worker] = EXITED
    except BaseException as exc:
        if not control.stop[worker]:
            from components.collector.env_threads import EnvFailed

            detail = (str(exc) if isinstance(exc, EnvFailed)  # already names which of the worker's envs raised
                      else traceback.format_exception_only(type(exc), exc)[-1].strip())
            ids = np.concatenate([b.env_ids for b in blocks])
            control.fail(worker, f"env worker {worker} (envs {ids.min()}-{ids.max()}) failed: {detail}")
            raise
        control.status[worker] = EXITED
    finally:
        for block in blocks:
            block.close()


def acquire_chunk(worker: int, chunks: ChunkWriter, control: WorkerControl) -> dict[str, np.ndarray] | None:
    """The next free chunk, or None within a bounded wait (the caller re-checks stop and pause); timed."""
    control.activity[worker] = WAITING_CHUNK
    started = time.perf_counter()
    chunk = chunks.acquire(_WAIT_S)
    control.timing[worker, 2] += time.perf_counter() - started
    return chunk


def _await(channel: ActionChannel, stop: np.ndarray, beat: Callable[[], None] | None = None) -> dict[str, np.ndarray]:
    """The response to the channel's request, in bounded turns: each one re-checks stop and beats.

    A slow server keeps the worker waiting here, never frozen: ``beat``
    (the worker's progress clock) advances every turn.
    """
    while True:
        try:
            return channel.wait(_WAIT_S * 5)
        except TimeoutError:
            if stop[0]:
                raise _Stopped() from None
            if beat is not None:
                beat()


def _loop(
    worker: int,
    blocks: list[EnvBlock],
    channels: list[ActionChannel],
    chunks: ChunkWriter,
    control: WorkerControl,
    mode: int,
    response_keys: tuple[str, ...],
) -> None:
    stop, pause, timing = control.stop[worker:worker + 1], control.pause, control.timing[worker]
    activity, heartbeat, reset_epoch = control.activity, control.heartbeat, control.reset_epoch
    progress, beats = control.progress, control.beats
    clock, monotonic = time.perf_counter, time.monotonic

    def beat() -> None:
        progress[worker] = monotonic()
        beats[worker] += 1

    # With an observation stream (see ChunkPool) each frame is written once, into the chunk row after the
    # step's: that row is what the next step acted on, and an inline policy reads it where it lies.
    streamed = chunks.stream == "observation"
    direct = [bool(getattr(channel, "acts_anywhere", False)) for channel in channels]
    last = chunks.chunk_len - 1
    spans, obs, first = [], [], 0
    #: per block: whether ``obs[i]`` already is row ``t`` of the current chunk (else it is copied there)
    placed = [False] * len(blocks)
    for block, channel in zip(blocks, channels):
        n = len(block)
        spans.append(slice(first, first + n))
        first += n
        obs.append(channel.request["observation"][:n])
        block.reset(obs[-1])
        channel.submit(n, mode)
        timing[5] += n
    held: list[dict[str, np.ndarray] | None] = [None] * len(blocks)
    chunk: dict[str, np.ndarray] | None = None
    cols: list[dict[str, np.ndarray]] = []
    row_keys = ("observation", *response_keys, *NEXT_KEYS)
    steps_down = np.arange(chunks.chunk_len, dtype=np.int64)[:, None]
    epoch = int(reset_epoch[0])
    t = 0
    while not stop[0]:
        beat()  # every turn, waits included (each wait below is bounded): a live worker always beats
        if pause[0]:
            # Quiesce: collect every answer in flight, then park.
            activity[worker] = WAITING_ACTIONS
            for i, channel in enumerate(channels):
                if held[i] is None:
                    held[i] = _await(channel, stop, beat)
            _park(worker, control)
            continue
        if chunk is None:
            chunk = acquire_chunk(worker, chunks, control)
            if chunk is None:
                continue  # re-check stop and pause
            t = 0
            # Per block, each field's column of this chunk (indexed by step below), and what is known for the
            # whole chunk at once: which envs fill it and their step counts (each step adds one to every env's).
            cols = [{key: chunk[key][:, span] for key in row_keys} for span in spans]
            for block, span in zip(blocks, spans):
                chunk["env_index"][:, span] = block.env_ids
                np.add(block.env_step, steps_down, out=chunk["env_step"][:, span])
        truncate = epoch != reset_epoch[0]  # reset_at_each_iter: a new batch began
        if truncate:
            epoch = int(reset_epoch[0])
        for i, (block, channel, span) in enumerate(zip(blocks, channels, spans)):
            n = span.stop - span.start
            started = clock()
            if held[i] is None:
                activity[worker] = WAITING_ACTIONS
                response = _await(channel, stop, beat)
            else:
                response = held[i]
            held[i] = None
            waited = clock()
            activity[worker] = STEPPING
            heartbeat[worker] = progress[worker] = monotonic()  # this block's step began: the step watchdog's clock
            timing[1] += waited - started
            col = cols[i]
            acted = col["observation"][t]
            if not placed[i]:
                acted[:] = obs[i]
            block.check_actions(response["action"][:n])  # before the chunk copy: a wrong shape named, not numpy's
            for key in response_keys:
                col[key][t] = response[key][:n]
            row = {key: col[key][t] for key in NEXT_KEYS}
            if streamed:
                fresh = col["observation"][t + 1]
                skipped = block.step(response["action"][:n], row, fresh, truncate, acted=acted, actions_checked=True)
                obs[i], placed[i] = fresh, t < last
            else:
                skipped = block.step(response["action"][:n], row, obs[i], truncate, actions_checked=True)
            if skipped:
                timing[6] += skipped  # env steps cut out as non-finite (trainer.nan_policy=skip)
            activity[worker] = WAITING_ACTIONS  # out of the step: (server=inline) the policy runs in submit
            if not streamed:
                channel.submit(n, mode)
            elif direct[i]:
                channel.submit(n, mode, obs[i])
            else:
                channel.request["observation"][:n] = obs[i]
                channel.submit(n, mode)
            timing[0] += clock() - waited
            timing[4] += n
            timing[5] += n
        heartbeat[worker] = monotonic()
        timing[3] += 1
        t += 1
        if t == chunks.chunk_len:
            chunks.commit()
            chunk = None
            # obs (row chunk_len of the committed chunk) is copied into the next one's first row; this
            # worker alone writes its chunks, and cycles through them in order, so nothing overwrites it first
            placed = [False] * len(blocks)


def transition_fields(observation: FieldSpec, response: tuple[FieldSpec, ...]) -> list[FieldSpec]:
    """Per-env fields of one stored transition: what acted, what came back, what followed."""
    return [
        observation,
        *response,
        FieldSpec("next.observation", observation.shape, observation.dtype),
        FieldSpec("next.reward", (), "float32"),
        FieldSpec("next.terminated", (), "bool"),
        FieldSpec("next.truncated", (), "bool"),
        FieldSpec("next.done", (), "bool"),
        FieldSpec("next.episode_return", (), "float32"),
        FieldSpec("next.episode_length", (), "int64"),
        FieldSpec("env_index", (), "int64"),
        FieldSpec("env_step", (), "int64"),
    ]
