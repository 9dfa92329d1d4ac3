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

import numpy as np

from components.action_noise import NOISE_KEY, BlockNoise
from components.collector.chunks import ChunkWriter
from components.collector.failures import FailureKind, NonFiniteStep
from components.collector.env_block import NEXT_KEYS, EnvBlock
from components.procname import set_name
from components.recurrent_state import IS_FIRST
from components.threads import report_pools
from components.collector.worker_control import (BUILDING, EXITED, RUNNING, STEPPING, WAITING_ACTIONS, WAITING_TURN,
                                                 ActionChannel, Stopped, WorkerControl, acquire_chunk, await_response,
                                                 park)
from components.shm import FieldSpec

#: how often a lockstep worker that has taken every step asked for looks for the next batch's
_TURN_POLL_S = 0.0002
#: the chunk fields a block step writes only where an episode ended (cleared once a chunk)
_FLAGS = ("next.terminated", "next.truncated", "next.done")
#: seconds between a worker's stores of its time and frame counts, at most (else once a chunk)
_FLUSH_S = 0.1
#: chunks whose step views a worker keeps (a writer cycles through a few; more are made per use)
_CACHED_CHUNKS = 16

#: one block's step ``t`` of a chunk: the observation acted on, its successor's row (a stream; else None),
#: the env half of the transition by key, and ``(key, row)`` for the response fields and recorded request fields
StepViews = tuple[np.ndarray, "np.ndarray | None", dict[str, np.ndarray], tuple[tuple[str, np.ndarray], ...],
                  tuple[tuple[str, np.ndarray], ...]]


def step_views(chunk: dict[str, np.ndarray], spans: list[slice], chunk_len: int, response_keys: tuple[str, ...],
               recorded: tuple[str, ...], streamed: bool) -> list[list[StepViews]]:
    """Per block (its ``span`` of the chunk's rows) and step, the rows of ``chunk`` that step writes.

    Made once per chunk rather than per step: indexing a dozen fields costs
    a few microseconds a step, a per-cent of a 32-env CartPole block's.
    """
    out = []
    for span in spans:
        cols = {key: chunk[key][:, span] for key in ("observation", *recorded, *response_keys, *NEXT_KEYS)}
        out.append([(cols["observation"][t], cols["observation"][t + 1] if streamed else None,
                     {key: cols[key][t] for key in NEXT_KEYS},
                     tuple((key, cols[key][t]) for key in response_keys),
                     tuple((key, cols[key][t]) for key in recorded)) for t in range(chunk_len)])
    return out

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
        control.fail(worker, f"env worker {worker} could not build its envs: {exc!r}", FailureKind.BUILD)
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
    except Stopped:
        control.status[worker] = EXITED
    except BaseException as exc:
        if not control.stop[worker]:
            from components.collector.env_threads import EnvFailed

            cause = exc.error if isinstance(exc, EnvFailed) else exc
            detail = (str(exc) if isinstance(exc, (EnvFailed, NonFiniteStep))  # already name the env that raised
                      else traceback.format_exception_only(type(exc), exc)[-1].strip())
            kind = FailureKind.NON_FINITE if isinstance(cause, NonFiniteStep) else FailureKind.CRASH
            ids = np.concatenate([b.env_ids for b in blocks])
            control.fail(worker, f"env worker {worker} (envs {ids.min()}-{ids.max()}) failed: {detail}", kind)
            raise
        control.status[worker] = EXITED
    finally:
        for block in blocks:
            block.close()


def run_loop(worker: int, blocks: list[EnvBlock], channels: list[ActionChannel], chunks: ChunkWriter,
             control: WorkerControl, mode: int, response_keys: tuple[str, ...]) -> None:
    """The step loop alone, without :func:`run_worker`'s reporting: the plan's probe times it on null envs."""
    _loop(worker, blocks, channels, chunks, control, mode, response_keys)


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

    beaten = [int(beats[worker])]  # the beat count, kept here and stored (a shared read-modify-write is dearer)

    def beat() -> None:
        progress[worker] = monotonic()
        beaten[0] += 1
        beats[worker] = beaten[0]

    # Time and row counts add up here, in Python numbers, and reach the shared timing row (flush) once a chunk
    # or _FLUSH_S after the last flush, whichever comes first: a few read-modify-writes of shared floats a step
    # cost ~1 us, and a slow env's chunk takes long (64 steps of 0.3 s: 19 s), which the monitor's intervals
    # would read as zero and then a lump. ``steps`` is stored every turn (one store): a hang report names the
    # step, and a replacement worker starts past it.
    spent = [0.0, 0.0, 0, 0]  # env_s, infer_wait_s, frames, rows_requested since the last flush
    steps_before = int(timing[3])
    flush_due = [clock() + _FLUSH_S]

    def flush() -> None:
        timing[0] += spent[0]
        timing[1] += spent[1]
        timing[4] += spent[2]
        timing[5] += spent[3]
        spent[:] = [0.0, 0.0, 0, 0]
        flush_due[0] = clock() + _FLUSH_S

    # With an observation stream (see ChunkPool) each frame is written once, into the chunk row after the
    # step's: that row is what the next step acted on, and an inline policy reads it where it lies.
    streamed = chunks.stream == "observation"
    direct = [bool(getattr(channel, "acts_anywhere", False)) for channel in channels]
    last = chunks.chunk_len - 1
    spans, obs, first = [], [], 0
    #: per block: whether ``obs[i]`` already is row ``t`` of the current chunk (else it is copied there)
    placed = [False] * len(blocks)
    #: per block, its envs' sampling noise (components.action_noise), sent with each request (None: the policy
    #: brings its own randomness)
    noises = [BlockNoise(block.seeds, channel.request[NOISE_KEY].shape[1]) if NOISE_KEY in channel.request else None
              for block, channel in zip(blocks, channels)]
    # A recurrent policy (components.recurrent): each env's state rides in its request and comes back as
    # ``next.<leaf>``; the chunk records the state each step acted with and whether it was an episode's first.
    state_keys = carried_state_keys(channels[0].request, response_keys)
    recorded = (*state_keys, IS_FIRST) if state_keys else ()
    for channel in channels:  # fresh envs start from zero state (a restarted worker's slot holds its predecessor's)
        for key in recorded:
            channel.request[key][:] = 0
        if state_keys:
            channel.request[IS_FIRST][:] = True
    # Lockstep (the driver set ``granted`` before the start): a block's request for turn k goes out only once
    # the driver has asked for k + 1 turns, so every step of a batch is served by the weights of that batch.
    granted = control.granted
    lockstep = int(granted[0]) >= 0
    taken = 0  # turns of this loop completed (each steps every block once)
    deferred = [False] * len(blocks)  # blocks whose next request waits for the driver's next turn

    sizes = [len(block) for block in blocks]

    def send(i: int) -> None:
        """Block ``i``'s request for its next step: its noise, its observation (unless acted on in place)."""
        n, channel = sizes[i], channels[i]
        if direct[i] and streamed:  # an inline policy reads both where they lie
            channel.submit(n, mode, obs[i], None if noises[i] is None else noises[i].current(blocks[i].steps))
        else:
            if noises[i] is not None:
                channel.request[NOISE_KEY][:n] = noises[i].current(blocks[i].steps)
            if streamed:
                channel.request["observation"][:n] = obs[i]
            channel.submit(n, mode)
        spent[3] += n

    for i, block in enumerate(blocks):
        n = len(block)
        spans.append(slice(first, first + n))
        first += n
        obs.append(channels[i].request["observation"][:n])
        block.reset(obs[-1])
        if lockstep and granted[0] <= 0:
            deferred[i] = True
        else:
            send(i)
    held: list[dict[str, np.ndarray] | None] = [None] * len(blocks)
    chunk: dict[str, np.ndarray] | None = None
    steps: list[list[StepViews]] = []
    views_of: dict[int, list[list[StepViews]]] = {}  # by the chunk's identity
    steps_down = np.arange(chunks.chunk_len, dtype=np.int64)[:, None]
    epoch = int(reset_epoch[0])
    t = 0
    try:
        while not stop[0]:
            beat()  # every turn, waits included (each wait below is bounded): a live worker always beats
            if pause[0]:
                # Quiesce: collect every answer in flight, then park.
                activity[worker] = WAITING_ACTIONS
                for i, channel in enumerate(channels):
                    if held[i] is None and not deferred[i]:
                        held[i] = await_response(channel, stop, beat)
                flush()
                park(worker, control)
                beaten[0] = int(beats[worker])  # park beat on the shared count
                continue
            if lockstep and any(deferred):
                if taken >= granted[0]:
                    activity[worker] = WAITING_TURN
                    time.sleep(_TURN_POLL_S)
                    continue
                for i in range(len(blocks)):
                    if deferred[i]:
                        deferred[i] = False
                        send(i)
            if chunk is None:
                chunk = acquire_chunk(worker, chunks, control)
                if chunk is None:
                    continue  # re-check stop and pause
                t = 0
                # Per block and step, the chunk's views a step writes (made once per chunk: the writer hands out
                # the same chunks in turn), and what is known for the whole chunk at once: which envs fill it and
                # their step counts (each step adds one to every env's).
                steps = views_of.get(id(chunk))
                if steps is None:
                    steps = step_views(chunk, spans, chunks.chunk_len, response_keys, recorded, streamed)
                    if len(views_of) < _CACHED_CHUNKS:
                        views_of[id(chunk)] = steps
                for block, span in zip(blocks, spans):
                    chunk["env_index"][:, span] = block.env_ids
                    np.add(block.steps, steps_down, out=chunk["env_step"][:, span])
                for key in _FLAGS:  # a step writes flags only where an episode ended (EnvBlock.step's flags_clear)
                    chunk[key].fill(False)
            truncate = epoch != reset_epoch[0]  # reset_at_each_iter: a new batch began
            if truncate:
                epoch = int(reset_epoch[0])
            for i, (block, channel, span) in enumerate(zip(blocks, channels, spans)):
                n = span.stop - span.start
                started = clock()
                if held[i] is None:
                    activity[worker] = WAITING_ACTIONS
                    response = await_response(channel, stop, beat)
                else:
                    response = held[i]
                held[i] = None
                waited = clock()
                activity[worker] = STEPPING
                heartbeat[worker] = progress[worker] = monotonic()  # this block's step began: the step watchdog's clock
                spent[1] += waited - started
                acted, fresh, row, answered, carried = steps[i][t]
                if not placed[i]:
                    acted[:] = obs[i]
                if direct[i]:  # an inline policy answers with exactly the block's rows
                    action = response["action"]
                    block.check_actions(action)  # before the chunk copy: a wrong shape named, not numpy's
                    for key, target in answered:
                        target[...] = response[key]
                else:  # a slot's response rows: the block's first n
                    action = response["action"][:n]
                    block.check_actions(action)
                    for key, target in answered:
                        target[...] = response[key][:n]
                for key, target in carried:
                    target[...] = channel.request[key][:n]
                if streamed:
                    skipped = block.step(action, row, fresh, truncate, acted=acted, actions_checked=True,
                                         flags_clear=True)
                    obs[i], placed[i] = fresh, t < last
                else:
                    skipped = block.step(action, row, obs[i], truncate, actions_checked=True, flags_clear=True)
                if skipped:
                    timing[6] += skipped  # env steps cut out as non-finite (trainer.nan_policy=skip)
                if state_keys:
                    carry_state(channel.request, response, state_keys, row["next.done"], n)
                activity[worker] = WAITING_ACTIONS  # out of the step: (server=inline) the policy runs in submit
                if lockstep and taken + 1 >= granted[0]:
                    deferred[i] = True  # the last step asked for: the next request waits for the next batch's weights
                else:
                    send(i)
                stepped = clock()
                spent[0] += stepped - waited
                spent[2] += n
            t += 1
            taken += 1
            timing[3] = steps_before + taken
            if t == chunks.chunk_len:
                flush()
                chunks.commit()
                chunk = None
                # obs (row chunk_len of the committed chunk) is copied into the next one's first row; this
                # worker alone writes its chunks, and cycles through them in order, so nothing overwrites it first
                placed = [False] * len(blocks)
            elif stepped > flush_due[0]:
                flush()
    finally:
        flush()  # what the last turns spent, however the loop ended


def carried_state_keys(request: dict[str, np.ndarray], response_keys: tuple[str, ...]) -> tuple[str, ...]:
    """A recurrent policy's state leaves: the request keys that come back as ``next.<key>`` (none: feed-forward)."""
    return tuple(k for k in request if f"next.{k}" in response_keys)


def carry_state(request: dict[str, np.ndarray], response: dict[str, np.ndarray], keys: tuple[str, ...],
                done: np.ndarray, n: int) -> None:
    """The next request's state: the response's next state, zero (and ``is_first``) where the episode ended."""
    ended = bool(done.any())
    for key in keys:
        target = request[key][:n]
        target[:] = response[f"next.{key}"][:n]
        if ended:
            target[done] = 0.0
    request[IS_FIRST][:n] = done


def transition_fields(observation: FieldSpec, response: tuple[FieldSpec, ...],
                      state: tuple[FieldSpec, ...] = ()) -> list[FieldSpec]:
    """Per-env fields of one stored transition: what acted (with which recurrent state), what came back, what
    followed."""
    return [
        observation,
        *state,
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
