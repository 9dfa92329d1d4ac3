"""The worker loop's own cost per block step, timed on the real loop.

Why the real loop: a worker's step is more than :meth:`EnvBlock.step`. It
also runs the inline policy's wrapper (weights poll, modes, version stamps,
statistics), the block's noise table, the loop's clocks, flags and beats,
the response copies into the chunk and a chunk's commit. Timed with
``EnvBlock.step`` alone, those 30-40 us a block step were missing from the
model: on CartPole it over-predicted two workers of 4 and 8 envs by 22-40 %
(`python -m pipeline.bench.worker_loop`: 30.0 / 20.2 us of a worker's CPU a
frame against the hand loop's 22.8 / 16.7), and could not see that one
worker of 16 envs trains faster than two of 8.

Here :func:`~components.collector.worker.run_loop` runs in a thread of this
process on a block of envs that step in no time, answered by the real
:class:`~components.inference.inline.InlinePolicy` around an engine that
answers in no time, writing into a real chunk pool that a second thread
empties. What its steps cost is the loop's own cost, and the model adds the
env's and the policy's as their probes measured them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.plan.machine_probes import STREAM_BYTES

#: Rounds of the timing (the median is kept) and the block sizes whose difference gives the per-env part.
ROUNDS = 5
SIZES = (1, 16)
#: Seconds the loop thread may take to stop once asked (it checks between steps).
STOP_S = 5.0


def stream_steps(rows: int, obs_nbytes: int) -> int:
    """Steps of a probe's chunk: as many as a chunk spans (up to 64), within :data:`STREAM_BYTES` for big frames.

    Examples:
        >>> stream_steps(16, 16), stream_steps(16, 100_800)
        (64, 20)
    """
    return int(min(64, max(2, STREAM_BYTES // max(1, rows * obs_nbytes))))


class NullEnv:
    """Steps in no time: what remains of a block's step is the loop's own cost."""

    def __init__(self, obs: Any, action_space: Any, observation_space: Any) -> None:
        self._obs, self.action_space, self.observation_space = obs, action_space, observation_space

    def reset(self, seed: int | None = None) -> tuple[Any, dict]:
        return self._obs, {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        return self._obs, 0.0, False, False, {}

    def close(self) -> None:
        pass


class _Answers:
    """An engine that answers in no time: one fixed response per batch size (the policy's own, on zeros)."""

    name = "null"

    def __init__(self, response: dict[str, np.ndarray]) -> None:
        self._response = response

    def act(self, inputs: dict[str, Any], modes: Any = None) -> dict[str, np.ndarray]:
        n = len(inputs["observation"])
        return {key: value[:n] for key, value in self._response.items()}


class _Published:
    """A weights arena that never publishes: the policy's poll reads one integer, as a worker's between updates."""

    seq = 0


def env_observation(env_spec: Any) -> Any:
    """An observation as the env returns it: a Dict/Tuple space's own structure (a sample of it), else zeros.

    The block checks each observation against the space, as a worker does:
    a packed row for a Dict/Tuple space broke the env's spec, and the layout
    probe then failed for every such env (the plan fell back to its rule).
    """
    if not env_spec.is_tree:
        return env_spec.zero_observation()
    space, _ = env_spec.spaces()
    space.seed(0)
    return space.sample()


def time_worker_loop(env_spec: Any, engine: Any, budget_s: float) -> tuple[float, float]:
    """(per-step, per-env) seconds of the worker loop's own work, without the env's and the policy's."""
    per = {n: _time_block(env_spec, engine, n, budget_s / len(SIZES)) for n in SIZES}
    small, large = SIZES
    per_env = max(0.0, (per[large] - per[small]) / (large - small))
    return max(0.0, per[small] - small * per_env), per_env


def _response(env_spec: Any, engine: Any, rows: int) -> dict[str, np.ndarray]:
    """The engine's response on zero observations, as ``rows`` rows per field."""
    first = env_spec.zero_observation()
    obs = np.broadcast_to(first, (rows, *first.shape)).copy()
    out = engine.act({"observation": obs}, np.zeros(rows, np.int8))
    return {k: np.ascontiguousarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in out.items()}


@dataclass
class InlineLoop:
    """The parts :func:`~components.collector.worker.run_loop` runs on: one block, its channel, its chunks."""

    block: Any
    pool: Any
    writer: Any
    channel: Any
    control: Any
    keys: tuple[str, ...]

    def run(self) -> None:
        """The loop until ``control.stop`` (a sampling policy's mode, as a collecting worker's)."""
        from components.collector.worker import run_loop
        from components.interaction import InteractionMode

        run_loop(0, [self.block], [self.channel], self.writer, self.control, int(InteractionMode.RANDOM), self.keys)


def inline_loop(env_spec: Any, response: dict[str, np.ndarray], make_env: Any, n: int) -> InlineLoop:
    """A worker loop over ``n`` envs from ``make_env``, its policy inline and answering ``response`` in no time.

    ``response``: the engine's fields for ``n`` rows (its ``policy_version`` is the policy's to stamp).
    """
    from components.collector.chunks import ChunkPool
    from components.collector.env_block import EnvBlock
    from components.collector.worker import transition_fields
    from components.collector.worker_control import WorkerControl
    from components.inference.inline import InlineChannel, InlinePolicy
    from components.inference.inline_stats import InlineStatsTable
    from components.inference.transport import POLICY_VERSION
    from components.shm import FieldSpec

    response = {k: v for k, v in response.items() if k != POLICY_VERSION}
    response_fields = tuple(FieldSpec(k, v.shape[1:], v.dtype.name) for k, v in response.items())
    response_fields += (FieldSpec(POLICY_VERSION, (), "int64"),)
    block = EnvBlock(make_env, list(range(n)), list(range(n)))
    chunk_len = stream_steps(n, env_spec.zero_observation().nbytes)
    pool = ChunkPool(transition_fields(env_spec.observation_field(), response_fields), rows=[n],
                     chunk_len=chunk_len, chunks_per_worker=4, ctx=threading, stream="observation",
                     dense_successor=False)
    policy = InlinePolicy(0, None, env_spec, "null", _Published(), InlineStatsTable(1, 0), seed=0
                          ).built_with(_Answers(response))
    # one uniform a row, as a categorical head samples with (the block's noise table, refilled every few steps)
    channel = InlineChannel(policy, n, env_spec.observation_field(), noise_width=1)
    return InlineLoop(block, pool, pool.writer(0), channel, WorkerControl(1), tuple(f.name for f in response_fields))


def _time_block(env_spec: Any, engine: Any, n: int, budget_s: float) -> float:
    """Median seconds per step of the real worker loop over one block of ``n`` null envs."""
    obs_space, action_space = env_spec.spaces()
    returned = env_observation(env_spec)
    loop = inline_loop(env_spec, _response(env_spec, engine, n),
                       lambda: NullEnv(returned, action_space, obs_space), n)
    block, pool, control = loop.block, loop.pool, loop.control
    done = threading.Event()

    def drain() -> None:  # the driver's part: each chunk back to the worker as soon as it is complete
        while not done.is_set():
            gid = pool.next_ready(0.01)
            if gid is not None:
                pool.release(gid)

    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run()
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    drainer = threading.Thread(target=drain, name="loop-probe-drain", daemon=True)
    looper = threading.Thread(target=run, name="loop-probe", daemon=True)
    drainer.start()
    looper.start()
    steps = control.timing[0]
    rounds: list[float] = []
    try:
        time.sleep(min(0.01, budget_s / 4))  # the first chunk's views are made on its first steps
        for _ in range(ROUNDS):
            before, start = int(steps[3]), time.perf_counter()
            time.sleep(budget_s / ROUNDS)
            taken, elapsed = int(steps[3]) - before, time.perf_counter() - start
            if taken > 0:
                rounds.append(elapsed / taken)
            if errors or not looper.is_alive():
                break
    finally:
        control.stop[0] = 1
        looper.join(STOP_S)
        done.set()
        drainer.join(STOP_S)
        block.close()
    if errors:
        raise errors[0]
    if not rounds:
        raise RuntimeError("the worker loop took no step within the probe")
    return float(np.median(rounds))
