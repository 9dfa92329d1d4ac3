"""A worker whose envs step concurrently, each in its own thread (``workers.concurrent_envs``).

The block loop of :mod:`components.collector.worker` steps a worker's envs
one after another and writes one chunk row per step of the whole block: an
env that answers in 1 ms waits for one that takes 20. For envs whose step
mostly *waits* (a simulator behind a socket, a renderer) that throws the
worker's time away, and the only remedy there was one process per env:
dozens of interpreters taking turns on a few cores, each waking to a cold
cache.

Here one worker process hosts many envs, each stepped by its own thread
(the wait releases the GIL), and the worker's main thread serves them as
they come back, like the inference server does: it takes every env that
has returned since it last looked, writes their transitions into the
chunk (rows in completion order: a chunk is a bag of transitions, each
naming its ``env_index`` and ``env_step``, which is how every consumer
orders them), asks the policy for all their actions in one call and sends
each env its action. No env ever waits for another's step.

Fault paths stay those of the block loop: an env that raises fails the
worker with the env's message; the worker's heartbeat is the start of its
oldest unfinished step, so the hang watchdog sees one hung env among many
busy ones; the main thread beats the worker's progress clock on every turn
(each wait is bounded), so a frozen worker is a hang too; a pause collects
every step in flight before parking.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from components.action_noise import NOISE_KEY, rows_noise
from components.collector.chunks import ChunkWriter
from components.collector.failures import NonFiniteStep
from components.collector.env_block import NEXT_KEYS, EnvBlock

#: How long the main thread blocks for a returning env before it re-checks stop and pause.
_POLL_S = 0.05
#: Written to an env thread's inbox to end it.
_STOP = None


class EnvFailed(Exception):
    """An env's step raised in its thread; raised again by the worker's main thread, naming the env."""

    def __init__(self, env: int, error: BaseException) -> None:
        # a non-finite step's line names the env already
        super().__init__(str(error) if isinstance(error, NonFiniteStep) else f"env {env} raised {type(error).__name__}: {error}")
        self.env, self.error = env, error


class EnvThread:
    """One env's stepping thread: waits for a go, steps with the action the main thread left, reports back."""

    def __init__(self, index: int, block: EnvBlock, action: np.ndarray, rows: dict[str, np.ndarray],
                 obs: np.ndarray, done: queue.SimpleQueue, started_at: np.ndarray) -> None:
        self.index, self.block, self._action, self._rows, self._obs = index, block, action, rows, obs
        self._done, self._started_at = done, started_at
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"env-{int(block.env_ids[0])}", daemon=True)

    def _run(self) -> None:
        block, inbox, done, k = self.block, self.inbox, self._done, self.index
        while True:
            truncate = inbox.get()
            if truncate is _STOP:
                return
            try:
                skipped = block.step(self._action, self._rows, self._obs, truncate)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which fails the worker
                done.put(EnvFailed(int(block.env_ids[0]), exc))
                return
            # No longer in a step: cleared here, not when the main thread gets to it, so a worker that was
            # waiting for a chunk meanwhile never looks hung on steps that already returned.
            self._started_at[k] = np.inf
            done.put(k if not skipped else -1 - k)  # negative: this step was cut out as non-finite


class ConcurrentEnvs:
    """The env threads of one worker and the per-env arrays they write into."""

    def __init__(self, blocks: Sequence[EnvBlock], obs: np.ndarray) -> None:
        self.blocks = list(blocks)
        n = len(self.blocks)
        spec = self.blocks[0].spec
        #: what each env's last step returned (its row of the next transition), and the obs to act on next
        self.rows = {key: np.zeros((n, *v.shape[1:]), v.dtype) for key, v in self.blocks[0].empty_rows().items()}
        self.obs = obs
        self.actions = np.zeros((n, *spec.action_shape), spec.action_dtype)
        self.env_ids = np.concatenate([b.env_ids for b in self.blocks])
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        #: monotonic start of each env's step in progress (inf: none); its thread clears it on return
        self.started_at = np.full(n, np.inf)
        self.threads = [
            EnvThread(k, b, self.actions[k:k + 1], {key: v[k:k + 1] for key, v in self.rows.items()},
                      obs[k:k + 1], self.done, self.started_at)
            for k, b in enumerate(self.blocks)
        ]
        self.in_flight = 0  # steps sent whose return the main thread has not taken yet

    def reset(self) -> None:
        for k, block in enumerate(self.blocks):
            block.reset(self.obs[k:k + 1])
        for t in self.threads:
            t.thread.start()

    def send(self, envs: np.ndarray, truncate: np.ndarray) -> None:
        """Start the step of each env in ``envs`` (its action is in :attr:`actions`)."""
        now = time.monotonic()
        self.started_at[envs] = now
        self.in_flight += len(envs)
        for k, cut in zip(envs.tolist(), truncate.tolist()):
            self.threads[k].inbox.put(cut)

    def returned(self, timeout: float) -> list[int]:
        """Envs whose step came back: wait up to ``timeout`` for one, then take all that are there."""
        try:
            first = self.done.get(timeout=timeout)
        except queue.Empty:
            return []
        out = [first]
        get = self.done.get_nowait
        while True:
            try:
                out.append(get())
            except queue.Empty:
                break
        for item in out:
            if isinstance(item, EnvFailed):
                raise item
        self.in_flight -= len(out)
        return out

    def oldest_step_start(self) -> float:
        """When the oldest step still in progress began (now, if none is): the worker's heartbeat."""
        oldest = float(self.started_at.min())
        return oldest if oldest != np.inf else time.monotonic()

    def stop(self) -> None:
        for t in self.threads:
            t.inbox.put(_STOP)
        deadline = time.monotonic() + 1.0
        for t in self.threads:
            if t.thread.is_alive():
                t.thread.join(max(0.0, deadline - time.monotonic()))  # a hung env's thread is a daemon: left


def _flat_rows(chunk: dict[str, np.ndarray], capacity: int) -> dict[str, Any]:
    """Each field of ``chunk`` as ``capacity`` rows, as views: ``[t, e]`` becomes ``t * rows + e``.

    A worker narrower than the pool's widest has strided chunk views that
    cannot be flattened without a copy; their rows are reached through
    (step, env) index arrays instead.
    """
    out: dict[str, Any] = {}
    for key, v in chunk.items():
        view = v.view()
        try:
            view.shape = (capacity, *v.shape[2:])
        except AttributeError:
            t, e = np.divmod(np.arange(capacity), v.shape[1])
            view = _Strided(v, t, e)
        out[key] = view
    return out


class _Strided:
    """Row assignment into a strided ``[steps, envs]`` chunk view by flat row numbers."""

    def __init__(self, array: np.ndarray, t: np.ndarray, e: np.ndarray) -> None:
        self.array, self.t, self.e = array, t, e

    def __setitem__(self, rows: slice, value: np.ndarray) -> None:
        self.array[self.t[rows], self.e[rows]] = value


def run_concurrent(worker: int, blocks: list[EnvBlock], channel: Any, chunks: ChunkWriter, control: Any,
                   mode: int, response_keys: tuple[str, ...]) -> None:
    """The worker loop for blocks of one env each, all stepping at once (see the module docstring)."""
    from components.collector.worker_control import STEPPING, WAITING_ACTIONS, acquire_chunk, await_response, park

    stop, pause, timing = control.stop[worker:worker + 1], control.pause, control.timing[worker]
    activity, heartbeat, reset_epoch = control.activity, control.heartbeat, control.reset_epoch
    progress, beats, monotonic = control.progress, control.beats, time.monotonic

    def beat() -> None:
        progress[worker] = monotonic()
        beats[worker] += 1

    clock = time.perf_counter
    request = channel.request["observation"]
    noise_request = channel.request.get(NOISE_KEY)  # each env's sampling noise (components.action_noise)
    n = len(blocks)
    seeds = np.array([block.seeds[0] for block in blocks], np.int64)
    envs = ConcurrentEnvs(blocks, np.zeros((n, *request.shape[1:]), request.dtype))
    acted = np.zeros_like(envs.obs)  # the observation each env's step in flight was acting on
    env_step = np.zeros(n, np.int64)  # that step's index in the env's life
    # reset_at_each_iter: each env truncates its first step after a new batch began (epoch per env)
    env_epoch = np.full(n, int(reset_epoch[0]), np.int64)
    responses: dict[str, np.ndarray] = {}
    envs.reset()
    try:
        def act(ks: np.ndarray) -> None:
            m = len(ks)
            request[:m] = envs.obs[ks]
            if noise_request is not None:
                steps = np.array([blocks[k].steps for k in ks.tolist()], np.int64)
                noise_request[:m] = rows_noise(seeds[ks], steps, noise_request.shape[1])
            started = clock()
            channel.submit(m, mode)
            # A slow server is waited for, not a step that hangs (the step watchdog skips this activity).
            activity[worker] = WAITING_ACTIONS
            response = await_response(channel, stop, beat)
            heartbeat[worker] = envs.oldest_step_start()  # first: the wait was no step
            activity[worker] = STEPPING
            timing[1] += clock() - started
            timing[5] += m
            if not responses:
                for key in response_keys:
                    v = np.asarray(response[key])
                    responses[key] = np.zeros((n, *v.shape[1:]), v.dtype)
            for key in response_keys:
                responses[key][ks] = response[key][:m]
            envs.actions[ks] = response["action"][:m]
            acted[ks] = request[:m]
            for k in ks.tolist():
                env_step[k] = blocks[k].steps
            epoch = int(reset_epoch[0])
            truncate = env_epoch[ks] != epoch
            env_epoch[ks] = epoch
            envs.send(ks, truncate)

        act(np.arange(n))
        pending: list[int] = []  # envs back from their step whose transition is not written yet
        chunk: dict[str, np.ndarray] | None = None
        flat: dict[str, Any] = {}
        capacity = chunks.chunk_len * chunks.rows
        written = 0
        while not stop[0]:
            beat()  # every turn, waits included (each is bounded): a live worker always beats
            if pause[0]:
                # Quiesce: every step in flight comes back (its transition is written after the pause);
                # an env that hangs meanwhile is still a hang to the watchdog.
                activity[worker] = STEPPING
                while envs.in_flight and not stop[0]:
                    beat()
                    heartbeat[worker] = envs.oldest_step_start()
                    pending += envs.returned(_POLL_S)
                park(worker, control)
                continue
            if chunk is None:
                chunk = acquire_chunk(worker, chunks, control)
                if chunk is None:
                    continue
                flat = _flat_rows(chunk, capacity)
                written = 0
            if not pending:
                activity[worker] = STEPPING
                heartbeat[worker] = envs.oldest_step_start()
                started = clock()
                pending = envs.returned(_POLL_S)
                timing[0] += clock() - started
                if not pending:
                    continue
            take = min(len(pending), capacity - written)
            back, pending = pending[:take], pending[take:]
            skipped = [-1 - k for k in back if k < 0]
            if skipped:
                timing[6] += len(skipped)
                back = [k if k >= 0 else -1 - k for k in back]
            ks = np.asarray(back, np.int64)
            rows = slice(written, written + take)
            flat["observation"][rows] = acted[ks]
            flat["env_index"][rows] = envs.env_ids[ks]
            flat["env_step"][rows] = env_step[ks]
            for key in response_keys:
                flat[key][rows] = responses[key][ks]
            for key in NEXT_KEYS:
                flat[key][rows] = envs.rows[key][ks]
            written += take
            timing[4] += take
            timing[3] += take / n
            act(ks)
            heartbeat[worker] = envs.oldest_step_start()
            if written == capacity:
                chunks.commit()
                chunk = None
    finally:
        envs.stop()
