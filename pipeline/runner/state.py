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
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch

from components.checkpoint import save_checkpoint
from components.replay.key_names import names_a_file
from pipeline.plan.validate import ConfigError


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


#: What every checkpoint of a run holds (:func:`run_state`); any trainer's state has a policy_version.
RUN_STATE_KEYS = ("frames", "policy_version", "config", "model_spec", "env_spec", "episodes", "rng", "stop_reason")
#: A replay leaf's key part becomes a file name under ``<run dir>/replay``: a plain name, never a path.


class CheckpointError(ConfigError):
    """A ``checkpoint.pt`` that is no run's state: missing, truncated, foreign or not a file (one line, exit 2)."""


def _first_line(err: BaseException) -> str:
    """The error's first line, printable (torch colours its messages) and short."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    first = "".join(c for c in text.splitlines()[0] if c.isprintable())[:200] if text else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _check_shape(state: Any) -> str | None:
    """Why ``state`` is not what :func:`run_state` wrote (None when it is)."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a run's state"
    missing = [key for key in RUN_STATE_KEYS if key not in state]
    if missing:
        return f"it lacks {', '.join(missing)}"
    if not isinstance(state["frames"], int) or isinstance(state["frames"], bool) or state["frames"] < 0:
        return f"frames={state['frames']!r} is not a count of frames"
    rng, episodes = state["rng"], state["episodes"]
    if not (isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor)
            and isinstance(rng.get("numpy"), dict)):
        return "its rng entry is not the RNG states a run saves"
    if not (isinstance(episodes, dict) and {"returns", "lengths", "total"} <= set(episodes)):
        return "its episodes entry is not the episode statistics a run saves"
    if not isinstance(state.get("model", {}), dict):
        return "its model entry is not a state dict"
    for entry in _replay_layout(state.get("replay")):
        parts = entry[0] if isinstance(entry, (list, tuple)) and entry else None
        if not isinstance(parts, (list, tuple)) or not parts or not all(names_a_file(p) for p in parts):
            return f"its replay layout names a file outside the replay directory ({parts!r})"
    return None


def _replay_layout(replay: Any) -> list[Any]:
    """The leaf layout of a disk replay's saved state (a frame-stack storage keeps it under ``rows``)."""
    storage = replay.get("storage") if isinstance(replay, dict) else None
    if isinstance(storage, dict) and isinstance(storage.get("rows"), dict):
        storage = storage["rows"]
    layout = storage.get("layout") if isinstance(storage, dict) else None
    return list(layout) if isinstance(layout, (list, tuple)) else []


def read_run_state(path: Path) -> dict[str, Any]:
    """The state in ``path`` if it is a checkpoint :func:`run_state` wrote, else :class:`CheckpointError`.

    Read before a resume builds anything (the run directory may come from
    someone else): only a regular file is opened (a FIFO would block, a
    directory cannot be loaded), ``weights_only=True`` unpickles no class
    and runs no code, and a file that loads but lacks what a resume reads
    (a foreign ``.pt``, a list) is refused here in one line rather than as a
    ``KeyError`` half-way through the start.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError("there is no checkpoint.pt") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint.pt cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError("checkpoint.pt is not a regular file")
    if info.st_size == 0:
        raise CheckpointError("checkpoint.pt is empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - truncated, foreign, a pickle with classes: all one line
        raise CheckpointError(f"checkpoint.pt is not a checkpoint torch can load with weights_only=True "
                              f"(truncated or foreign: {_first_line(err)})") from None
    reason = _check_shape(state)
    if reason is not None:
        raise CheckpointError(f"checkpoint.pt is not a run's checkpoint: {reason}")
    return state


def load_run_state(path: Path) -> dict[str, Any]:
    """A checkpoint written by :func:`run_state`, loaded without unpickling any class (see :func:`read_run_state`)."""
    try:
        return read_run_state(path)
    except CheckpointError as err:
        raise CheckpointError(f"{path.parent}: {err}") from None


def restore_episodes(tracker: Any, episodes: dict[str, Any]) -> None:
    tracker.add(episodes["returns"], episodes["lengths"])
    tracker.total = int(episodes["total"])
