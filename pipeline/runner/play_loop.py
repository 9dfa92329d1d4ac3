"""The loop that plays one episode on each of several envs at once, the policy batched over them.

Shared by the evaluator (:mod:`pipeline.runner.evaluation`), the video
process (:mod:`pipeline.runner.video_recorder`) and ``python -m
pipeline.play``, so all three play the same episodes from the same weights
and seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from components.interaction import InteractionMode
from components.obs_tree import ObsLeaf, model_observation
from components.recurrent import zero_state
from components.video import FrameRecorder


def play_episodes(model: torch.nn.Module, envs: list[Any], seeds: list[int], mode: InteractionMode,
                  row: Callable[[Any], np.ndarray], max_steps: int, recorder: FrameRecorder | None = None,
                  every_episode: bool = False, obs_leaves: Sequence[ObsLeaf] = ()) -> tuple[list[float], list[int]]:
    """One episode on each env at once (env ``i`` reset with ``seeds[i]``), the policy batched over them.

    Returns the returns and lengths of the episodes that ended (all of them
    unless ``max_steps`` cut them; ``every_episode``: of every env, in order,
    cut ones included). ``recorder`` takes each recorded env's
    frame after its reset and after every step. Also what
    ``python -m pipeline.play`` plays, so its returns are the evaluation's.
    """
    n = len(envs)
    obs = np.stack([row(env.reset(seed=int(s))[0]) for env, s in zip(envs, seeds)])
    if recorder is not None:
        for i, env in enumerate(envs):
            recorder.capture(i, env)
    live = np.ones(n, bool)
    returns, lengths = np.zeros(n), np.zeros(n, np.int64)
    modes = torch.full((n,), int(mode), dtype=torch.int8)
    space = envs[0].action_space
    low, high = getattr(space, "low", None), getattr(space, "high", None)
    steps = 0
    # a recurrent policy (components.recurrent): every episode starts from zero state, carried step to step
    state = zero_state(model, n)
    while live.any() and steps < max_steps:
        with torch.no_grad():
            out = model.act({"observation": model_observation(obs_leaves, torch.as_tensor(obs)), **state}, modes)
            actions = out["action"].numpy()
            state = {k: out[f"next.{k}"] for k in state}
        for i in np.flatnonzero(live):
            action = actions[i]
            if low is not None:
                action = np.clip(action, low, high)
            elif not action.shape:  # Discrete: an int; MultiDiscrete and MultiBinary take their row as it is
                action = int(action)
            o, r, terminated, truncated, _ = envs[i].step(action)
            obs[i] = row(o)
            returns[i] += float(r)
            lengths[i] += 1
            if recorder is not None:
                recorder.capture(i, envs[i])
            if terminated or truncated:
                live[i] = False
        steps += 1
    done = ~live
    if every_episode:
        return returns.tolist(), lengths.tolist()
    return returns[done].tolist() or returns.tolist(), lengths[done].tolist() or lengths.tolist()
