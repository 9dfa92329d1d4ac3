"""What the runner checks and builds for evaluation before anything is written.

A bad ``eval`` setting must be one line before the run directory is
claimed: an ``eval.envs`` entry whose env does not build, or whose
observations or actions differ from the training env's (the same policy
plays both), and, with ``eval.video=true``, an env that does not render
``rgb_array`` frames, are found here by building one env of each.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from components.video import VideoError, frame_of, render_factory
from pipeline.plan.eval_settings import EvalSettings, eval_settings
from pipeline.plan.validate import ConfigError
from pipeline.runner.evaluation import EvaluationError, Evaluator
from pipeline.runner.video_recorder import VideoRecorder

__all__ = ["EvalSetup", "EvaluationError", "build_evaluator", "check_renders", "prepare_evaluation"]


@dataclass
class EvalSetup:
    """Checked settings and the factories of the ``eval.envs`` entries, by name."""

    settings: EvalSettings
    extra: dict[str, Any] = field(default_factory=dict)


def check_renders(factory: Any, what: str) -> None:
    """Build one rendering env of ``factory``, reset it, take a frame; a :class:`ConfigError` if it cannot."""
    import warnings

    env = None
    try:
        with warnings.catch_warnings():  # a renderer that cannot start warns first (GLFW): the error says it
            warnings.simplefilter("ignore")
            env = render_factory(factory)()
            env.reset(seed=0)
            frame_of(env)
    except VideoError as err:
        raise ConfigError(f"eval.video=true: {err}") from None
    except Exception as err:  # noqa: BLE001 - e.g. a renderer a headless machine lacks (MuJoCo without GL)
        text = str(err).strip().splitlines()
        raise ConfigError(f"eval.video=true: {what} cannot render rgb_array frames here: "
                          f"{type(err).__name__}: {text[0] if text else ''}") from None
    finally:
        if env is not None:
            env.close()


def prepare_evaluation(cfg: DictConfig, env_factory: Any, env_spec: Any) -> EvalSetup:
    """The run's evaluation, checked (deprecation notes printed); raises :class:`ConfigError` with one line."""
    from pipeline.plan.inputs import build_env

    settings = eval_settings(cfg)
    for note in settings.notes:
        print(note, file=sys.stderr, flush=True)
    extra = {}
    for name, env_cfg in settings.envs.items():
        try:
            factory, spec = build_env(OmegaConf.create({"env": env_cfg}))
        except ConfigError as err:
            raise ConfigError(f"eval.envs.{name}: {err}") from None
        if spec.spaces() != env_spec.spaces():
            raise ConfigError(f"eval.envs.{name}: its env's observations or actions ({spec.spaces()}) differ from "
                              f"the training env's ({env_spec.spaces()}); the same policy plays both")
        extra[name] = factory
    if settings.video is not None:
        check_renders(env_factory, str(OmegaConf.select(cfg, "env.id", default="the env")))
    return EvalSetup(settings, extra)


def build_evaluator(setup: EvalSetup | None, env_factory: Any, model_spec: Any, env_spec: Any, seed: int,
                    run_dir: Path) -> Evaluator | None:
    """The run's :class:`Evaluator` (None when nothing is evaluated during the run), its video process ready."""
    if setup is None or not setup.settings.enabled:
        return None
    s = setup.settings
    recorder = None if s.video is None else VideoRecorder(env_factory, model_spec, env_spec, s.video, int(s.mode),
                                                          run_dir / "videos")
    return Evaluator(env_factory, model_spec.build(env_spec), episodes=s.episodes, seed=seed, mode=s.mode,
                     extra=setup.extra, recorder=recorder)
