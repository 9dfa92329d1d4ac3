"""The trainer's cost per collected frame: the run's own trainer timed, or one optimiser step standing in.

:func:`time_training` times one optimiser step of
the model (forward, backward, clipping, Adam) and scales it by the steps a
batch takes. A trainer does more around each step: PPO the loss's own
element-wise operations, the minibatch indexing, the per-step metrics, and
per batch the ordering, GAE and the bootstrap forward; DQN and SAC the draw
from the buffer, the target networks and the losses. On CartPole PPO that
stand-in read 32-35 us a frame where the run's updates took 48-53 us
(``train/update_ms`` / ``frames_per_batch``), so the plan promised 1.5x the
frames/s a trainer-bound run got, and took apart layouts that trained at
the same speed. Where it fits the probe's budget, the run's own trainer
(built from ``cfg.trainer`` as the runner builds it, on a copy of the
model) is timed: an on-policy one on a batch of zeros shaped like the
collector's, a replay one on steps from a buffer of such zeros.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from components.obs_tree import model_observation

#: updates timed at most (the fastest is kept: a busy moment must not change the layout)
_MAX_TIMED = 4


def _fastest(call: Callable[[], Any], budget_s: float, most: int) -> float:
    """Seconds of the fastest of up to ``most`` calls after a warm-up (the optimiser's state, first allocations),
    as many as fit ``budget_s`` (at least one)."""
    timings: list[float] = []
    while len(timings) <= most and (len(timings) < 2 or sum(timings) + timings[-1] < budget_s):
        started = time.perf_counter()
        call()
        timings.append(time.perf_counter() - started)
    return min(timings[1:])


def replay_steps_per_frame(trainer: Any) -> float:
    """Gradient steps a replay trainer takes per collected frame, as the runner's loop gives them (0: none).

    DQN takes ``updates_per_batch`` steps per batch, SAC ``updates_per_frame``.
    """
    if "updates_per_batch" in trainer:
        return int(trainer.updates_per_batch) / max(1, int(trainer.frames_per_batch))
    return float(trainer.get("updates_per_frame", 0.0))


def trainer_load(trainer: Any) -> tuple[int, float]:
    """(rows per optimiser step, optimiser steps per collected frame) of a trainer config.

    PPO passes over each batch ``epochs`` times in ``minibatches`` steps; a
    replay trainer takes :func:`replay_steps_per_frame` steps of
    ``batch_size`` rows, each of SAC's counted as 4 steps of the served actor.
    A trainer with neither is not counted (0 steps).
    """
    frames = max(1, int(trainer.frames_per_batch))
    if "epochs" in trainer:
        minibatches = max(1, int(trainer.minibatches))
        return max(1, frames // minibatches), int(trainer.epochs) * minibatches / frames
    steps = replay_steps_per_frame(trainer)
    if steps <= 0:
        return 1, 0.0
    # SAC: per critic step, the critics' forward and backward on the batch and on the actor's draw, the
    # target critics and the actor's sample of the next observations: about 4 of the actor's steps
    return max(1, int(trainer.batch_size)), steps * (4.0 if "updates_per_frame" in trainer else 1.0)


#: Seconds the trainer probe may spend (a Nature CNN's step on the CPU is measured on fewer rows).
TRAINER_PROBE_S = 0.25
#: Seconds the run's own updates may take to be timed (:mod:`pipeline.plan.update_probe`), the warm-up included.
UPDATE_PROBE_S = 0.3


def time_training(model: Any, env_spec: Any, rows: int, budget_s: float = TRAINER_PROBE_S) -> float:
    """Seconds of one optimiser step (forward, backward, clipping, Adam) on ``rows`` rows of this model.

    A stand-in for the trainer's step (its loss is a few more element-wise
    operations), on a copy of the model so the run's initial weights are
    untouched. Steps of 8 and 32 rows give a fixed and a per-row cost; a
    full step that would not fit the budget (a Nature CNN on the CPU) is
    extrapolated from them, otherwise it is timed. Each size keeps its
    fastest reading: a step slowed by a busy moment must not change the
    layout (scaling one slow 8-row step up 32x once made a CartPole
    trainer look 30x dearer than it is).
    """

    import torch

    model = copy.deepcopy(model).train()
    first = env_spec.zero_observation()
    leaves = env_spec.obs_leaves  # a Dict/Tuple: the model reads its leaves, as from a batch
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    params = [p for p in model.parameters() if p.requires_grad]

    # a model of the user's own may have no forward (the contract asks PPO's for evaluate): step through that
    forward = model if type(model).forward is not torch.nn.Module.forward else \
        (lambda obs: model.evaluate(obs, torch.from_numpy(env_spec.zero_actions(obs.shape[0]))))

    def step(n: int) -> float:
        obs = model_observation(leaves, torch.from_numpy(np.broadcast_to(first, (n, *first.shape)).copy()))
        started = time.perf_counter()
        out = forward(obs)
        loss = sum(t.float().mean() for t in (out if isinstance(out, tuple) else (out,)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return time.perf_counter() - started

    small, mid = min(rows, 8), min(rows, 32)
    step(small)  # warm-up: first calls allocate (and import what the optimiser needs)
    t_small = min(step(small) for _ in range(3))
    if mid == small:
        return t_small
    t_mid = min(step(mid) for _ in range(3))
    # Noise can make the two sizes read alike: never call more than 3/4 of the 32-row step fixed.
    per_row = max((t_mid - t_small) / (mid - small), t_mid / mid / 4)
    estimate = t_mid + per_row * (rows - mid)
    if rows == mid or estimate > budget_s / 4:
        return estimate
    timings = [step(rows)]
    while sum(timings) < budget_s / 2 and len(timings) < 20:
        timings.append(step(rows))
    return min(timings)


def synthetic_batch(env_spec: Any, model: Any, frames: int, num_envs: int, dense_successors: bool = True) -> Any:
    """A collector's batch of ``frames`` zero transitions from ``num_envs`` envs in step order.

    Every env's last step in the batch is cut (no successor in it), as in
    a real batch, so PPO bootstraps those rows as it would. Without
    ``dense_successors`` only those rows' successors are carried, as the
    collector gives such a trainer (:mod:`components.successors`).
    """
    import torch
    from tensordict import TensorDict

    from components.recurrent_state import state_leaves

    envs = max(1, min(int(num_envs), frames))
    steps = -(-frames // envs)
    first = env_spec.zero_observation()
    leaves = env_spec.obs_leaves
    obs = model_observation(leaves, torch.from_numpy(np.broadcast_to(first, (frames, *np.shape(first))).copy()))
    zeros = torch.zeros(frames)
    off = torch.zeros(frames, dtype=torch.bool)
    actions = torch.from_numpy(env_spec.zero_actions(frames))
    fields: dict[Any, Any] = {
        "observation": obs,
        "action": actions,
        "sample_log_prob": _behaviour_log_prob(model, obs, actions),
        "state_value": zeros.clone(),
        "policy_version": torch.zeros(frames, dtype=torch.int64),
        "env_index": torch.arange(envs).repeat(steps)[:frames],
        "env_step": torch.arange(steps).repeat_interleave(envs)[:frames],
        ("next", "observation"): obs.clone(),
        ("next", "reward"): zeros.clone(),
        ("next", "terminated"): off.clone(),
        ("next", "truncated"): off.clone(),
        ("next", "done"): off.clone(),
    }
    for key, shape in state_leaves(model).items():  # a recurrent model's state, as recorded and returned
        fields[key] = torch.zeros(frames, *shape)
        fields[("next", key)] = torch.zeros(frames, *shape)
    if dense_successors:
        return TensorDict(fields, batch_size=[frames])
    from components.successors import CUT_SUCCESSORS_KEY, CutSuccessors

    fields.pop(("next", "observation"))  # cut successors: each env's last row, as the collector records
    last = torch.arange(max(0, frames - envs), frames)  # in step order, each env's last row
    batch = TensorDict(fields, batch_size=[frames])
    packed = torch.from_numpy(np.broadcast_to(first, (len(last), *np.shape(first))).copy())
    batch.set_non_tensor(CUT_SUCCESSORS_KEY, CutSuccessors(batch["env_index"][last], batch["env_step"][last],
                                                           packed, leaves))
    return batch


def _behaviour_log_prob(model: Any, obs: Any, actions: Any) -> Any:
    """The log-probability the model gives the batch's action: the importance ratio is 1, as in a run.

    With zeros instead the ratio is far from 1, every row is clipped and a
    ``target_kl`` stops the update after its first epoch: the timing would
    be of a fraction of a real update.
    """
    import torch

    from components.recurrent_state import state_leaves

    rows = obs.shape[0]
    if not callable(getattr(model, "evaluate", None)):  # a Q-network (DQN): its batches carry no log-probability
        return torch.zeros(rows)
    leaves = state_leaves(model)
    with torch.no_grad():
        if leaves:  # each row's own state: zeros, as the batch records
            state = {k: torch.zeros(1, *shape) for k, shape in leaves.items()}
            log_prob = model.evaluate_sequences(obs[:1, None], actions[:1, None], state)[0].reshape(-1)[:1]
        else:
            log_prob = model.evaluate(obs[:1], actions[:1])[0]
    return log_prob.float().expand(rows).clone()


def time_on_policy_update(cfg: Any, model: Any, env_spec: Any, estimate_s: float, budget_s: float) -> float | None:
    """Seconds per collected frame of one update of the run's trainer, or None where it is not timed.

    An update too long for ``budget_s`` (``estimate_s``: the stand-in's
    guess of one whole update) is timed on fewer minibatches of the run's
    size, from as many fewer envs: per frame it costs what the whole one does
    (``epochs`` steps of the same rows, the same share of cut trajectories).
    None: the trainer learns from replay (its updates need a filled buffer),
    or even one minibatch would not fit (a Nature CNN on the CPU), or the
    trainer failed on the zero batch (the stand-in's figure stays).
    """
    from pipeline.plan.trainer_spec import build_trainer, dense_successors

    frames = max(1, int(cfg.trainer.frames_per_batch))
    minibatches = max(1, int(cfg.trainer.get("minibatches", 1)))
    # a warm-up and one timed update must fit, each up to 1.5x the stand-in's guess (measured): keep the
    # minibatches that do
    kept = min(minibatches, int(minibatches * budget_s / max(3 * estimate_s, 1e-12)))
    if kept < 1:
        return None
    shrunk = {} if kept == minibatches else {"frames_per_batch": frames // minibatches * kept, "minibatches": kept}
    frames = shrunk.get("frames_per_batch", frames)
    envs = max(1, round(int(cfg.env.num_envs) * frames / max(1, int(cfg.trainer.frames_per_batch))))
    try:
        trainer = build_trainer(cfg, copy.deepcopy(model).cpu(), env_spec, "cpu", 0, **shrunk)
        if not getattr(trainer, "on_policy", False):
            return None
        batch = synthetic_batch(env_spec, trainer.model, frames, envs, dense_successors(cfg, env_spec))

        def update() -> None:
            # collected by the current weights: a batch stamped older is dropped as stale after a few updates
            batch["policy_version"].fill_(int(trainer.policy_version))
            trainer.update(batch.clone(), frames=frames)

        return _fastest(update, budget_s, _MAX_TIMED) / frames
    except Exception:  # noqa: BLE001 - a trainer this probe cannot feed keeps the stand-in's figure
        return None


#: rows a replay probe's buffer holds (samples of a batch size drawn from it, as from a filled buffer)
_REPLAY_ROWS = 2048


def time_replay_step(cfg: Any, model: Any, env_spec: Any, estimate_s: float, budget_s: float) -> float | None:
    """Seconds of one gradient step of the run's replay trainer: a sample drawn, ``learn`` on it, priorities fed back.

    The stand-in's optimiser step misses what a DQN or SAC step does
    around it: the draw from the buffer, the target network's forward on
    the successors, the loss, and SAC's second critic and actor step. The
    run's trainer (on a copy of the model) learns from an in-memory buffer
    of the run's sampler, filled with zero transitions. None: not a replay
    trainer with ``learn``, a warm-up and a timed step would not fit
    ``budget_s`` (``estimate_s``: the stand-in's guess of one step), or the
    trainer failed on the zero rows (the stand-in's figure stays).
    """
    from components.replay.buffer import ReplayBuffer
    from components.replay.storage import TensorStorage
    from pipeline.plan.trainer_spec import build_trainer

    if 3 * estimate_s > budget_s or "batch_size" not in cfg.trainer:
        return None
    rows = max(_REPLAY_ROWS, 2 * int(cfg.trainer.batch_size))
    try:
        trainer = build_trainer(cfg, copy.deepcopy(model).cpu(), env_spec, "cpu", 0)
        if getattr(trainer, "on_policy", True) or not callable(getattr(trainer, "learn", None)):
            return None
        replay = cfg.replay
        buffer = ReplayBuffer(TensorStorage(rows), sampler=str(replay.kind), alpha=float(replay.alpha),
                              beta=float(replay.beta), seed=0)
        buffer.extend(synthetic_batch(env_spec, trainer.model, rows, int(cfg.env.num_envs)))
        size = int(cfg.trainer.batch_size)

        def step() -> None:
            sample = buffer.sample(size)
            _, td_abs = trainer.learn(sample)
            buffer.update_priorities(sample["index"], td_abs.detach().cpu())

        return _fastest(step, budget_s, 2 * _MAX_TIMED)
    except Exception:  # noqa: BLE001 - a trainer this probe cannot feed keeps the stand-in's figure
        return None
