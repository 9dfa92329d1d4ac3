"""What learns in a run: the trainer and its model, its replay, and the hook run on each batch.

Built from the config once the plan is known (the trainer's device comes
from it); a user's mistake in any of them (a continuous-action env for
DQN, a ``_target_`` that is not a Trainer, a hook that does not import) is
a :class:`~pipeline.plan.validate.ConfigError`, one line before anything starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from components.models import ModelSpec
from components.trainers.base import Trainer
from pipeline.plan.model_spec import build_model, model_spec_for
from pipeline.plan.trainer_spec import build_trainer
from pipeline.plan import Plan
from pipeline.plan.validate import ConfigError


def build_learner(cfg: DictConfig, env_spec: Any, plan: Plan) -> tuple[ModelSpec, Trainer]:
    """The model spec (what the server rebuilds) and the trainer owning the learner's copy.

    The trainer comes from the trainer node's ``_target_`` (its other keys are
    the hyper-parameters), so a new algorithm is a new config, not a branch here.
    """
    model_spec = model_spec_for(cfg)
    model = build_model(cfg, model_spec, env_spec)
    # a trainer with networks of its own beside the served one (SAC's critics) builds them from the env spec
    trainer = build_trainer(cfg, model, env_spec, plan.trainer_device, int(cfg.collector.policy_version))
    if not isinstance(trainer, Trainer):
        raise ConfigError(f"trainer._target_={cfg.trainer._target_!r}: not a Trainer "
                          "(needs on_policy, policy_version, update, state_dict)")
    return model_spec, trainer


def post_collect_hook(cfg: DictConfig) -> Any:
    """The callable ``collector.post_collect_hook`` names (None when unset)."""
    path = cfg.collector.post_collect_hook
    if path is None:
        return None
    from hydra.utils import get_method

    try:
        return get_method(str(path))
    except Exception as err:  # noqa: BLE001 - any import problem is the user's path
        raise ConfigError(f"collector.post_collect_hook={path!r}: not an importable callable "
                          f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None


def build_replay(cfg: DictConfig, run_dir: Path, plan: Plan, algo: Any, env_spec: Any) -> tuple[Any, Any]:
    """The replay buffer and the n-step transform the writer applies (or None, None)."""
    r = cfg.replay
    if r.kind == "none":
        return None, None
    from components.replay.buffer import ReplayBuffer
    from components.replay.frames import FrameStackStorage, tree_frame_keys
    from components.replay.nstep import NStepReturns
    from components.replay.storage import TensorStorage

    path = run_dir / "replay" if r.storage == "disk" else None
    if plan.frame_dedup:  # a Dict/Tuple: its image leaves' frames are shared, its other leaves stored whole
        keys = tree_frame_keys(env_spec.obs_leaves) if env_spec.is_tree else ["observation", ("next", "observation")]
        storage: Any = FrameStackStorage(int(r.capacity), path=path, frame_keys=keys)
    else:
        storage = TensorStorage(int(r.capacity), device=plan.storing_device if path is None else "cpu", path=path)
    per_batch = getattr(algo, "updates_per_batch", None)  # SAC: updates_per_frame
    per_batch = per_batch if per_batch is not None else algo.updates_per_frame * algo.frames_per_batch
    updates = max(1, int(algo.total_frames // algo.frames_per_batch * per_batch))
    buffer = ReplayBuffer(storage, sampler=str(r.kind), alpha=float(r.alpha), beta=float(r.beta),
                          beta_steps=updates, eps=float(r.eps), max_policy_lag=r.max_policy_lag, seed=int(cfg.seed))
    return buffer, NStepReturns(int(algo.n_step), float(algo.gamma))


def final_write_bytes(trainer: Trainer, cfg: DictConfig) -> int:
    """What the last checkpoint may need on disk: model, optimiser moments, a target copy, replay bookkeeping."""
    model = sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
    replay = 16 * int(cfg.replay.capacity) if cfg.replay.kind != "none" and cfg.replay.storage == "disk" else 0
    return 4 * model + replay + (8 << 20)


class ReplayInCheckpoints:
    """Whether the next checkpoint holds the replay: always on disk (by reference) and when deterministic,
    else while a memory replay's rows fit ``replay.checkpoint_max_mb`` (a resumed run then samples what the
    killed one would have; one note, once, when they stop fitting)."""

    def __init__(self, buffer: Any, cfg: DictConfig, deterministic: bool) -> None:
        self.buffer = buffer
        self.always = buffer is not None and (cfg.replay.storage == "disk" or deterministic)
        limit = cfg.replay.get("checkpoint_max_mb") if buffer is not None else None
        self.limit_bytes = None if limit is None else float(limit) * 1e6
        self.noted = False

    def rows_bytes(self) -> float:
        storage = self.buffer.storage
        return storage.nbytes * len(storage) / max(1, storage.capacity)

    def __call__(self) -> bool:
        if self.buffer is None:
            return False
        if self.always:
            return True
        if self.limit_bytes is None:
            return False
        fits = self.rows_bytes() <= self.limit_bytes
        if not fits and not self.noted:
            self.noted = True
            print(f"note: the memory replay's rows ({self.rows_bytes() / 1e6:,.0f} MB) are past "
                  f"replay.checkpoint_max_mb={self.limit_bytes / 1e6:g}: checkpoints no longer hold them (a resumed "
                  "run refills its replay; replay.storage=disk keeps it)", file=sys.stderr, flush=True)
        return fits
