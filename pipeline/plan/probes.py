"""The layout model's probes: what one env step, one policy pass, the worker loop, a wake-up and a copy cost here.

:func:`measure` takes a few hundred milliseconds before a run (or each
benchmark trial) and returns the :class:`~pipeline.plan.layout.Costs` that
:func:`~pipeline.plan.layout.predict` turns into frames/s. Each probe times
short rounds and keeps their median, so one busy moment of the machine
does not move the plan (two probes of the same workload used to predict
77,000 and 108,000 frames/s for one layout).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.plan.layout import BATCHES, DEFAULT_HOP_S, Costs
from pipeline.plan.loop_probe import NullEnv, env_observation, stream_steps, time_worker_loop
from pipeline.plan.machine_probes import BIG_FRAME_BYTES, STREAM_BYTES, time_hop, time_shared_copy
from pipeline.plan.trainer_probe import (UPDATE_PROBE_S, replay_steps_per_frame, time_on_policy_update, time_replay_step,
                                         time_training, trainer_load)

#: Rounds each probe is split into; the median round is kept.
ROUNDS = 5


def _median(values: list[float]) -> float:
    return float(np.median(values))


class _MaskedActions:
    """Steps a masked env with an allowed action whatever action it is given (the probe's random ones are not)."""

    def __init__(self, env: Any, key: str, obs: Any) -> None:
        from components.action_masks import allowed_action

        self.env, self.key, self.obs = env, key, obs
        self.action_space, self._pick, self._rng = env.action_space, allowed_action, np.random.default_rng(0)

    def step(self, action: Any) -> Any:
        result = self.env.step(self._pick(self.action_space, self.obs[self.key], self._rng))
        self.obs = result[0]
        return result

    def reset(self) -> Any:
        self.obs, info = self.env.reset()
        return self.obs, info

    def close(self) -> None:
        self.env.close()


class _EnvTimer:
    """One env of the run's factory, stepped in timed windows, resets included as a run pays them.

    Why windows: a window of fast steps is a few milliseconds (at most
    :data:`ENV_PROBE_STEPS` steps in all), and on a shared VM a busy moment
    that long slowed most rounds of one: a CartPole step read 11-13 us
    against 7.5-8.9 in the trials beside it, and the prediction fell 34-39 %
    below what the layout then collected. A busy moment only ever slows a
    window, so the faster of two taken apart (see :func:`measure`) is the
    steady cost.
    """

    def __init__(self, factory: Callable[[], Any]) -> None:
        env = self._env = factory()
        try:
            self._start(env)
        except BaseException:
            env.close()
            raise

    def _start(self, env: Any) -> None:
        obs, _ = env.reset(seed=0)
        env.action_space.seed(0)
        mask_key = getattr(env, "action_mask_leaf", None)
        if mask_key is not None:  # a masked env: each action one its last observation allows
            env = self._env = _MaskedActions(env, mask_key, obs)
        # as the worker passes them (numpy integers and float32 arrays): some envs call array methods on them
        self._actions = [env.action_space.sample() for _ in range(64)]
        for action in self._actions[:4]:  # warm-up: first steps allocate
            self._step(action)
        self._steps = 0
        self._per_round = 0  # steps per round, sized by the first window's first round

    def _step(self, action: Any) -> None:
        _, _, term, trunc, _ = self._env.step(action)
        if term or trunc:
            self._env.reset()

    def window(self, budget_s: float, max_steps: int) -> tuple[float, float]:
        """Wall and thread-CPU seconds of one step: the median round's of about ``budget_s`` (``max_steps`` at most)."""
        walls: list[float] = []
        cpus: list[float] = []
        actions, steps = self._actions, 0
        deadline = time.perf_counter() + budget_s
        first = self._per_round == 0
        per_round = max(1, self._per_round)
        while (time.perf_counter() < deadline and steps < max_steps) or len(walls) < 3:
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(per_round):
                self._step(actions[(self._steps + steps) % len(actions)])
                steps += 1
            walls.append((time.perf_counter() - w0) / per_round)
            cpus.append((time.thread_time() - c0) / per_round)
            if first:
                first, walls, cpus = False, [], []  # the first step after the warm-up is not a typical one
                # up to 16 steps, about an eighth of the budget each
                per_round = self._per_round = int(min(16, max(1, budget_s / 8 / max(1e-9, time.perf_counter() - w0))))
        self._steps += steps
        wall = _median(walls)
        # thread_time ticks coarsely on some kernels (one round can read 0): the CPU share over all rounds
        return wall, wall * min(1.0, sum(cpus) / max(1e-12, sum(walls)))

    def close(self) -> None:
        self._env.close()


def _time_env(factory: Callable[[], Any], budget_s: float) -> tuple[float, float]:
    """Wall and thread-CPU seconds of one env step in one window (see :class:`_EnvTimer`)."""
    timer = _EnvTimer(factory)
    try:
        return timer.window(budget_s, ENV_PROBE_STEPS)
    finally:
        timer.close()


def _time_policy(engine: Any, first: np.ndarray, budget_s: float) -> dict[int, float]:
    """Per-sample seconds at each of :data:`BATCHES`, the sizes taken in turn within each round.

    ``first``: one observation the policy can take (each row of every batch).
    In turn, not one size after the other: a busy moment then slows one
    round of every size, not every round of one (a trial once read 787 us a
    sample at 1 row against ~170 in the next, and chose one worker for two).
    """
    inputs = {b: ({"observation": np.broadcast_to(first, (b, *first.shape)).copy()}, np.zeros(b, np.int8))
              for b in BATCHES}
    for obs, modes in inputs.values():
        engine.act(obs, modes)
    rounds: dict[int, list[float]] = {b: [] for b in BATCHES}
    for _ in range(ROUNDS):
        for b, (obs, modes) in inputs.items():
            reps, start = 0, time.perf_counter()
            while (time.perf_counter() - start < budget_s / len(BATCHES) / ROUNDS and reps < 400) or reps < 1:
                engine.act(obs, modes)
                reps += 1
            rounds[b].append((time.perf_counter() - start) / reps / b)
    return {b: _median(r) for b, r in rounds.items()}


def _time_loop(env_spec: Any, budget_s: float) -> tuple[float, float]:
    """(per-step, per-env) cost of stepping a block and writing its transition, without env time.

    The plan's loop figure for big frames and where the real loop's probe
    (:mod:`pipeline.plan.loop_probe`) fails: ``EnvBlock.step`` alone, which
    leaves out the loop around it.

    What the worker loop does per block step with an observation stream
    (see :class:`~components.collector.chunks.ChunkPool`): the chunk row's
    small fields, the env outputs, each observation written once into the
    next stream row, over as many rows as a chunk spans (out of the caches
    for big frames).
    """

    from components.collector.env_block import NEXT_KEYS, EnvBlock

    obs = env_spec.zero_observation()
    returned = env_observation(env_spec)  # as the env returns it (a Dict/Tuple's own structure)
    obs_space, space = env_spec.spaces()
    make_actions = env_spec.zero_actions
    # the worker's own bookkeeping per block step: its clocks and the control block's counters
    control, clock, monotonic = np.zeros(8), time.perf_counter, time.monotonic

    blocks: list[Any] = []

    def block_step(n: int) -> Callable[[], None]:
        block = EnvBlock(lambda: NullEnv(returned, space, obs_space), list(range(n)), list(range(n)))
        steps = stream_steps(n, obs.nbytes)
        chunk = {k: np.zeros((steps, *v.shape), v.dtype) for k, v in block.empty_rows().items()}
        actions = make_actions(n)
        chunk.update(action=np.zeros((steps, *actions.shape), actions.dtype), policy_version=np.zeros((steps, n), np.int64),
                     sample_log_prob=np.zeros((steps, n), np.float32), state_value=np.zeros((steps, n), np.float32))
        stream = np.zeros((steps + 1, n, *env_spec.obs_shape), env_spec.obs_dtype)
        block.reset(stream[0])
        blocks.append(block)
        where = [0]

        def one() -> None:
            t = where[0]
            began = clock()
            control[0] = control[1] = monotonic()
            control[2] += clock() - began
            block.check_actions(actions)
            chunk["action"][t] = actions
            chunk["policy_version"][t] = 0
            chunk["sample_log_prob"][t] = 0
            chunk["state_value"][t] = 0
            row = {key: chunk[key][t] for key in NEXT_KEYS}
            block.step(actions, row, stream[t + 1], acted=stream[t], actions_checked=True)
            control[3] += clock() - began
            control[4] += n
            control[5] += n
            where[0] = (t + 1) % steps

        return one

    sizes = {n: block_step(n) for n in (1, 16)}
    rounds: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(ROUNDS):  # the two sizes in turn (see _time_policy)
        for n, one in sizes.items():
            reps, start = 0, time.perf_counter()
            while (time.perf_counter() - start < budget_s / 2 / ROUNDS and reps < 1000) or reps < 4:
                one()
                reps += 1
            rounds[n].append((time.perf_counter() - start) / reps)
    for block in blocks:
        block.close()
    per = {n: _median(r) for n, r in rounds.items()}
    per_env = max(0.0, (per[16] - per[1]) / 15)
    return max(0.0, per[1] - per_env), per_env


def _time_copy(budget_s: float) -> float:
    """Seconds per byte of a copy too big for the caches: what moving a frame through memory costs here."""
    src = np.ones(STREAM_BYTES, np.uint8)
    dst = np.empty_like(src)
    dst[:] = src  # the first touch maps the pages
    rounds = []
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline or len(rounds) < 3:
        start = time.perf_counter()
        dst[:] = src
        rounds.append((time.perf_counter() - start) / src.nbytes)
        if len(rounds) >= 9:
            break
    return _median(rounds)


#: Seconds the env probe may take before the run goes on without it (an env that hangs must not
#: hang the run before its workers and their watchdogs exist).
ENV_PROBE_TIMEOUT_S = 10.0
#: Env steps the probe takes at most (it steps the user's env: keep it short).
ENV_PROBE_STEPS = 1000


class ProbeError(RuntimeError):
    """The env could not be timed (it raised, or did not return)."""


def _bounded(probe: Callable[[], Any]) -> Any:
    """``probe()`` (which steps the user's env) in a daemon thread, given up after :data:`ENV_PROBE_TIMEOUT_S`."""
    import threading

    result: list[Any] = []

    def run() -> None:
        try:
            result.append(probe())
        except BaseException as err:  # noqa: BLE001 - reported below
            result.append(err)

    thread = threading.Thread(target=run, name="layout-env-probe", daemon=True)
    thread.start()
    thread.join(ENV_PROBE_TIMEOUT_S)
    if not result:
        raise ProbeError(f"an env step did not return within {ENV_PROBE_TIMEOUT_S:g} s")
    if isinstance(result[0], BaseException):
        raise ProbeError(f"the env raised {type(result[0]).__name__}: {result[0]}") from result[0]
    return result[0]


def _time_env_bounded(factory: Callable[[], Any], budget_s: float) -> tuple[float, float]:
    """:func:`_time_env` in a daemon thread, given up after :data:`ENV_PROBE_TIMEOUT_S`."""
    return _bounded(lambda: _time_env(factory, budget_s))


def _time_worker_loop(env_spec: Any, engine: Any, budget_s: float) -> tuple[float, float]:
    """:func:`~pipeline.plan.loop_probe.time_worker_loop`, or :func:`_time_loop` for big frames or where it fails.

    A policy the null loop cannot answer for (its response on zeros not a
    transition's fields) must not end the run in its plan: the block's
    step alone is timed then, as before, with a warning naming why.
    """
    if env_spec.obs_bytes >= BIG_FRAME_BYTES:
        return _time_loop(env_spec, budget_s)
    try:
        return time_worker_loop(env_spec, engine, budget_s)
    except Exception as err:  # noqa: BLE001 - the fallback below is the older, narrower probe
        warnings.warn(f"the worker-loop probe failed ({type(err).__name__}: {err}); the plan times the env block's "
                      "step alone", RuntimeWarning, stacklevel=2)
        return _time_loop(env_spec, budget_s)


def measure(factory: Callable[[], Any], engine: Any, env_spec: Any, cpus: int, budget_s: float = 0.4,
            hop_s: float | None = None) -> Costs:
    """Probe every cost the prediction needs (about ``budget_s`` plus a process start for the hop)."""
    # The env and the policy in two windows each, the other probes between them, and the faster kept: a
    # busy moment of the machine slows one window, never both (see _EnvTimer).
    timer: _EnvTimer = _bounded(lambda: _EnvTimer(factory))
    first_obs = env_spec.zero_observation()
    try:
        env_first = _bounded(lambda: timer.window(budget_s * 0.2, ENV_PROBE_STEPS // 2))
        infer_first = _time_policy(engine, first_obs, budget_s * 0.15)
        # The real worker loop (its policy wrapper, noise, clocks, commits); big frames keep the probe that writes
        # them through chunk-sized memory, since a real pool that size is hundreds of MB of fresh pages
        loop_step, loop_env = _time_worker_loop(env_spec, engine, budget_s * 0.25)
        copy_s = _time_copy(budget_s * 0.1)
        env_second = _bounded(lambda: timer.window(budget_s * 0.15, ENV_PROBE_STEPS // 2))
    except ProbeError as err:
        if err.__cause__ is not None:  # the env raised (a hung one is left to its daemon thread)
            with contextlib.suppress(ProbeError):
                _bounded(timer.close)
        raise
    _bounded(timer.close)
    wall, cpu = min(env_first, env_second)  # the faster window's (by wall time)
    infer_second = _time_policy(engine, first_obs, budget_s * 0.15)
    infer = {b: min(infer_first[b], infer_second[b]) for b in infer_first}
    if hop_s is None:
        try:
            hop_s = time_hop()
        except (OSError, TimeoutError):
            hop_s = DEFAULT_HOP_S  # no child process here (a sandbox): a typical figure
    hop = hop_s
    obs_bytes = env_spec.obs_bytes
    action_bytes = int(np.prod(env_spec.action_shape, dtype=np.int64)) * np.dtype(env_spec.action_dtype).itemsize
    # observation and successor, the action, and ~60 bytes of flags, counters, return, version, value, log-prob
    frame_bytes = 2 * obs_bytes + action_bytes + 60
    share = 1.0
    if obs_bytes >= BIG_FRAME_BYTES:
        try:
            share = time_shared_copy(cpus)
        except (OSError, ValueError):
            share = 1.0  # no child process here (a sandbox): as if the copies did not slow each other
    return Costs(wall, cpu, infer, loop_step, loop_env, hop, getattr(engine, "name", "torch"), cpus,
                 obs_bytes=obs_bytes, frame_bytes=frame_bytes, copy_s_per_byte=copy_s, copy_share=share)


def probe_for_config(cfg: Any, factory: Callable[[], Any], env_spec: Any, cpus: int, policy_device: str,
                     engine: str, trainer_device: str = "cpu", count_trainer: bool = True) -> Costs:
    """:func:`measure` for a run's config: its model, on its policy device, with the engine the plan chose.

    With a trainer on the CPU, its cost per frame enters the prediction: a
    layout that is fastest for collection alone can slow the learner that
    shares its interpreter. The run's own trainer is timed where it fits
    the budget (:mod:`pipeline.plan.trainer_probe`: a PPO update, a DQN or
    SAC gradient step), else one optimiser step of the model stands in
    (:func:`trainer_load`, :func:`time_training`).
    ``count_trainer=False`` leaves it out: a layout for collection alone
    (the benchmark's ``ours:auto``, which trains nothing).
    """
    from dataclasses import replace

    from components.inference.serving import serving_engine
    from pipeline.plan.model_spec import model_spec_for
    from pipeline.plan.trainer_spec import dense_successors

    model = model_spec_for(cfg).build(env_spec)
    served = serving_engine(model.to(policy_device).eval(), engine, policy_device, "cpu", seed=0,
                            obs_leaves=env_spec.obs_leaves)
    costs = measure(factory, served, env_spec, cpus)
    if not dense_successors(cfg, env_spec):  # the driver copies no successors but those of cut trajectories
        costs = replace(costs, frame_bytes=costs.frame_bytes - costs.obs_bytes)
    rows, steps_per_frame = trainer_load(cfg.trainer)
    if not count_trainer or trainer_device != "cpu" or steps_per_frame == 0:
        return costs
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(int(cfg.torch_threads))  # as the trainer will run
    try:
        trainer_s = time_training(model.cpu(), env_spec, rows) * steps_per_frame
        # the run's own update or gradient step where it fits the budget: the stand-in misses what PPO, DQN
        # and SAC do around each optimiser step
        if "epochs" in cfg.trainer:
            update_s = time_on_policy_update(cfg, model, env_spec, trainer_s * int(cfg.trainer.frames_per_batch),
                                             UPDATE_PROBE_S)
        else:
            per_frame = replay_steps_per_frame(cfg.trainer)
            step_s = None if per_frame <= 0 else time_replay_step(cfg, model, env_spec, trainer_s / per_frame,
                                                                  UPDATE_PROBE_S)
            update_s = None if step_s is None else step_s * per_frame
    finally:
        torch.set_num_threads(threads)
    return replace(costs, trainer_s=trainer_s if update_s is None else update_s)
