"""Memory and disk budgets, checked before anything starts.

A run whose buffers cannot fit should say so in one line before the plan is
printed, not die minutes later with ENOMEM in a memory map, a SIGBUS on a
full disk, or a 160 GB sparse file. The estimates are per-transition bytes
times counts (observations dominate; a fixed allowance covers the small
fields), compared with what the machine has now.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from components.obs_tree import frame_leaves
from pipeline.plan.validate import ConfigError

#: Bytes per transition for everything but observations (actions, rewards, flags, indices, values).
SMALL_FIELDS_BYTES = 96
#: Frames stored per transition by frame dedup (see components.replay.frames.default_frame_capacity).
DEDUP_FRAMES_PER_TRANSITION = 1.125


def available_memory() -> int | None:
    """``MemAvailable`` in bytes (Linux), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def free_disk(path: Path) -> int:
    """Free bytes on the file system that ``path`` (or its nearest existing parent) is on."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def transition_bytes(env_spec: Any, *, frame_dedup: bool = False) -> int:
    """Bytes of one stored transition: an observation, its successor and the small fields."""
    obs = env_spec.obs_bytes
    if frame_dedup and env_spec.is_tree:  # the image leaves as frames, the rest of each packed row whole
        images = frame_leaves(env_spec.obs_leaves)
        frame = images[0].nbytes // images[0].shape[0]
        rest = obs - sum(leaf.nbytes for leaf in images)
        return int(len(images) * frame * DEDUP_FRAMES_PER_TRANSITION) + 2 * rest + SMALL_FIELDS_BYTES
    if frame_dedup:
        frame = obs // env_spec.obs_shape[0]
        return int(frame * DEDUP_FRAMES_PER_TRANSITION) + SMALL_FIELDS_BYTES
    return 2 * obs + SMALL_FIELDS_BYTES


def check_budgets(cfg: Any, plan: Any, env_spec: Any, run_dir: Path) -> None:
    """Raise :class:`ConfigError` when the run's buffers cannot fit in memory or on disk."""
    g = plan.graph
    frames_per_batch = int(cfg.trainer.frames_per_batch)
    per_transition = transition_bytes(env_spec)
    chunked = g.chunks_per_worker_for(frames_per_batch) * g.chunk_len * g.num_envs
    # chunk buffers, plus the assembled batch and a trainer-side copy of it
    collector_bytes = (chunked + 2 * frames_per_batch) * per_transition
    memory = available_memory()
    need_memory = collector_bytes
    replay_memory = replay_disk = 0
    if cfg.replay.kind != "none":
        stored = int(cfg.replay.capacity) * transition_bytes(env_spec, frame_dedup=bool(plan.frame_dedup))
        if cfg.replay.storage == "disk":
            replay_disk = stored
        elif str(plan.storing_device) == "cpu":
            replay_memory = stored
    need_memory += replay_memory
    if memory is not None and need_memory > 0.9 * memory:
        if replay_memory > collector_bytes:
            key = f"replay.capacity={cfg.replay.capacity}"
            fix = "lower it, or replay.storage=disk"
        else:
            key = f"trainer.frames_per_batch={frames_per_batch}"
            fix = "lower it (or chunking.chunks_per_worker)"
        raise ConfigError(f"{key}: the run needs about {_gb(need_memory)} of memory "
                          f"(chunk buffers and batches {_gb(collector_bytes)}, replay {_gb(replay_memory)}), "
                          f"this machine has {_gb(memory)} available; {fix}")
    if replay_disk:
        free = free_disk(run_dir)
        if replay_disk > 0.95 * free:
            raise ConfigError(f"replay.capacity={cfg.replay.capacity}: a disk replay of about {_gb(replay_disk)} "
                              f"does not fit the {_gb(free)} free under {str(run_dir)!r}; lower it or pick "
                              "another hydra.run.dir")
    if not math.isfinite(need_memory):  # pragma: no cover - defensive
        raise ConfigError("the run's buffer sizes overflow")
