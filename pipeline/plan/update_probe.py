"""The trainer's cost per collected frame, timed on the run's own on-policy update.

:func:`~pipeline.plan.probes.time_training` times one optimiser step of
the model (forward, backward, clipping, Adam) and scales it by the steps a
batch takes. A PPO update does more around each step: the loss's own
element-wise operations, the minibatch indexing, the per-step metrics, and
per batch the ordering, GAE and the bootstrap forward. On CartPole that
stand-in read 35-40 us a frame where the run's updates took 53-76 us
(``train/update_ms`` / ``frames_per_batch``), so the plan promised 1.5-1.9x
the frames/s a trainer-bound run got, and took layouts apart that trained
at the same speed. Where it fits the probe's budget, the run's own trainer
(built from ``cfg.trainer`` as the runner builds it, on a copy of the
model) is timed on a batch of zeros shaped like the collector's.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

#: updates timed at most (the fastest is kept: a busy moment must not change the layout)
_MAX_TIMED = 4


def synthetic_batch(env_spec: Any, model: Any, frames: int, num_envs: int) -> Any:
    """A collector's batch of ``frames`` zero transitions from ``num_envs`` envs in step order.

    Every env's last step in the batch is cut (no successor in it), as in
    a real batch, so PPO bootstraps those rows as it would.
    """
    import torch
    from tensordict import TensorDict

    from components.recurrent_state import state_leaves

    envs = max(1, min(int(num_envs), frames))
    steps = -(-frames // envs)
    obs = torch.from_numpy(np.broadcast_to(env_spec.zero_observation(),
                                           (frames, *np.shape(env_spec.zero_observation()))).copy())
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
    return TensorDict(fields, batch_size=[frames])


def _behaviour_log_prob(model: Any, obs: Any, actions: Any) -> Any:
    """The log-probability the model gives the batch's action: the importance ratio is 1, as in a run.

    With zeros instead the ratio is far from 1, every row is clipped and a
    ``target_kl`` stops the update after its first epoch: the timing would
    be of a fraction of a real update.
    """
    import torch

    from components.recurrent_state import state_leaves

    rows = obs.shape[0]
    with torch.no_grad():
        if state_leaves(model):  # each row's own state: zeros, as the batch records
            state = {k: torch.zeros(1, *shape) for k, shape in state_leaves(model).items()}
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
    from hydra.utils import instantiate

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
        make = instantiate(cfg.trainer, _partial_=True, _convert_="all", **shrunk)
        trainer = make(model=copy.deepcopy(model).cpu(), device="cpu", policy_version=0)
        if not getattr(trainer, "on_policy", False):
            return None
        batch = synthetic_batch(env_spec, trainer.model, frames, envs)
        timings: list[float] = []  # the first is the warm-up (the optimiser's state, first allocations)
        while len(timings) <= _MAX_TIMED and (len(timings) < 2 or sum(timings) + timings[-1] < budget_s):
            # collected by the current weights: a batch stamped older is dropped as stale after a few updates
            batch["policy_version"].fill_(int(trainer.policy_version))
            started = time.perf_counter()
            trainer.update(batch.clone(), frames=frames)
            timings.append(time.perf_counter() - started)
    except Exception:  # noqa: BLE001 - a trainer this probe cannot feed keeps the stand-in's figure
        return None
    return min(timings[1:]) / frames
