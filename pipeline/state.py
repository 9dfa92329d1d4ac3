"""What a checkpoint holds, and how a resumed run gets it back.

Everything in a checkpoint is a tensor or a plain Python value, so it loads
with ``torch.load(weights_only=True)``: no pickled classes, nothing that runs
code on load. The layout is flat, the trainer's state at the top (``model``,
``optimizer``, ``policy_version``, ...) next to the run's: ``frames``,
``config``, ``model_spec``, ``env_spec``, ``episodes``, ``rng``,
``wandb_id``, ``stop_reason`` and, for a disk replay, ``replay`` and ``nstep``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components.checkpoint import save_checkpoint


def rng_state() -> dict[str, Any]:
    """The driver's global RNG states (torch and numpy) as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))


def run_state(*, trainer: Any, frames: int, config: dict[str, Any], model_spec: Any, env_spec: Any,
              tracker: Any, stop_reason: str, wandb_id: str | None, replay: Any = None,
              nstep: Any = None) -> dict[str, Any]:
    """The checkpoint of a run at ``frames`` collected transitions."""
    state = dict(trainer.state_dict())
    state.update(
        frames=int(frames),
        config=config,
        model_spec={"target": model_spec.target, "kwargs": model_spec.kwargs},
        env_spec=dataclasses.asdict(env_spec),
        episodes={"returns": [float(r) for r in tracker.returns], "lengths": [int(n) for n in tracker.lengths],
                  "total": int(tracker.total)},
        episode_return_mean=float(tracker.mean_return),
        stop_reason=stop_reason,
        rng=rng_state(),
        wandb_id=wandb_id,
    )
    if replay is not None:
        state["replay"] = replay.state_dict()
        state["nstep"] = nstep.state_dict() if nstep is not None else None
    return state


def save_run_state(path: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically (see :func:`components.checkpoint.save_checkpoint`)."""
    return save_checkpoint(path, state)


def load_run_state(path: Path) -> dict[str, Any]:
    """A checkpoint written by :func:`run_state`, loaded without unpickling any class."""
    return torch.load(path, map_location="cpu", weights_only=True)


def restore_episodes(tracker: Any, episodes: dict[str, Any]) -> None:
    tracker.add(episodes["returns"], episodes["lengths"])
    tracker.total = int(episodes["total"])
