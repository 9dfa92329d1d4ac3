"""The part of a trainer's config that the runner, not the algorithm, reads."""

from __future__ import annotations

from dataclasses import dataclass

from components.kinds import NanPolicy, TargetMetric


@dataclass
class RunBudget:
    """How much to collect and when to stop, shared by every trainer.

    ``target_return`` stops the run once the mean return of the last
    ``target_window`` episodes reaches it (``None``: run to ``total_frames``).
    ``nan_policy`` says what a NaN or infinite reward or observation from an
    env does: ``error`` stops the run naming the env; ``skip`` cuts that
    step out (a zero-reward truncation, the env reset) and counts it in
    ``collector/non_finite_skipped``.
    """

    #: the trainer's label in run names and the plan
    name: str = ""
    #: transitions per collected batch (one update for PPO, updates_per_batch for DQN)
    frames_per_batch: int = 256
    #: stop after this many transitions
    total_frames: int = 100_000
    #: stop once the mean return of the last target_window episodes reaches this (None: never)
    target_return: float | None = None
    #: episodes the target_return mean is taken over
    target_window: int = 20
    #: a NaN/inf reward or observation: error (stop, naming the env) or skip (cut out, counted)
    nan_policy: NanPolicy = NanPolicy.error
    #: deprecated (a note says so): eval.interval
    eval_interval: int | None = None
    #: deprecated (a note says so): eval.episodes
    eval_episodes: int | None = None
    #: what target_return is compared with: "train" (the collecting policy's episodes) or "eval"
    target_metric: TargetMetric = TargetMetric.train
