"""What makes a run reproducible, and what its summary says about it.

Two modes (docs/configuration.md, "Reproducible runs"):

- **async** (the default): actions come from each env's own noise stream,
  so they never depend on which envs shared a batch, but which weights
  served a step depends on timing: two runs of one seed agree statistically.
- **deterministic** (``deterministic=true``): lockstep collection
  (:mod:`components.collector.lockstep`), one forward per worker block,
  torch's deterministic algorithms, rows at frame counts: two runs of one
  config on the same machine and software write the same rows (but the
  wall-time columns, :func:`timing_column`) and the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

import numpy as np
import torch

#: keys of the resolved config that do not change what a run computes: where it goes, how it is shown
_NOT_HASHED = ("resume", "progress", "rundir")

#: separates the re-seed stream from the env seeds derived from the same (seed, frames)
_RESEED_TAG = 0x5EED

#: metric columns that measure the clock, not the run (they differ between two identical runs)
_TIMING = re.compile(r"^time$|_ms$|_s$|seconds$|_frac$|^collector/bound$"
                     # what the server has applied when the row is written (the version each step was served by
                     # is exact: the lockstep collector checks it)
                     r"|^collector/policy_version$|^server/policy_version$|^server/weight_updates")


def apply_determinism(deterministic: bool) -> None:
    """deterministic=true: torch's deterministic algorithms (before any CUDA work; children inherit the env)."""
    if not deterministic:
        return
    # cuBLAS needs a fixed workspace for deterministic matmuls; set before CUDA is initialised
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def env_seed_at(seed: int, frames: int) -> int:
    """The env seed of a collector started at ``frames`` (a resumed run, a restart point); ``seed`` at 0."""
    return int(np.random.SeedSequence([int(seed), int(frames)]).generate_state(1)[0]) if frames else int(seed)


def reseed(seed: int, frames: int) -> None:
    """The driver's torch and numpy RNGs re-seeded from (seed, frames): a restart point's, a resumed run's."""
    value = int(np.random.SeedSequence([int(seed), int(frames), _RESEED_TAG]).generate_state(1)[0])
    torch.manual_seed(value)
    np.random.seed(value)


def config_hash(resolved: dict[str, Any]) -> str:
    """A short hash of what the run computes: the resolved config without where its outputs go."""
    kept = {key: value for key, value in resolved.items() if key not in _NOT_HASHED}
    text = json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def timing_column(key: str) -> bool:
    """Whether metric column ``key`` measures wall time (frames/s, latencies, fractions of time)."""
    return bool(_TIMING.search(key))


def summary_row(collector: Any, reporter: Any, stop_reason: str, *, deterministic: bool,
                resolved: dict[str, Any]) -> dict[str, Any]:
    """The run's summary: frames, time, outcome, the last return, the mode and the config's hash."""
    tracker = reporter.tracker
    return {
        "frames": collector.frames,
        "wall_time_s": round(reporter.elapsed, 3),
        "collector/frames_per_s": round(collector.frames / reporter.elapsed, 1) if reporter.elapsed else None,
        "stop_reason": stop_reason,
        "episode/return_mean": tracker.mean_return,
        "episode/count": tracker.total,
        **({k: v for k, v in reporter.tasks.row().items() if not k.endswith("/length_mean")}
           if reporter.tasks is not None else {}),
        # the final evaluation (its frames name its video, its seed_index is what pipeline.play replays)
        **{f"eval/{k}": v for k, v in (reporter.last_eval or {}).items() if k != "seconds"},
        "solved": stop_reason == "target_return",
        "mode": "deterministic" if deterministic else "async",
        "config_hash": config_hash(resolved),
    }
