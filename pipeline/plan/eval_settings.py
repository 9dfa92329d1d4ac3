"""What the ``eval`` group asks for, with the deprecated ``trainer.eval_*`` keys folded in.

Evaluation used to be configured by ``trainer.eval_interval`` and
``trainer.eval_episodes``; runs and sweeps that still set them keep working,
with one note each, and an ``eval.*`` key the user also set wins. Everything
that reads evaluation settings (the runner, ``pipeline.play``, the plan,
validation) goes through :func:`eval_settings`, so the two spellings never
disagree.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from components.interaction import InteractionMode

#: the one-line notes a run that still sets a deprecated key prints
DEPRECATED = {
    "eval_interval": "note: trainer.eval_interval is deprecated and will be removed: use eval.interval",
    "eval_episodes": "note: trainer.eval_episodes is deprecated and will be removed: use eval.episodes",
}
#: frames per second of videos when neither eval.video_fps nor the env's metadata says
DEFAULT_FPS = 30


@dataclass(frozen=True)
class VideoSettings:
    """Videos of evaluation episodes: which evaluations, how many episodes, how long, how fast."""

    every: int = 1
    episodes: int = 1
    fps: int | None = None
    max_steps: int = 1000


@dataclass(frozen=True)
class EvalSettings:
    """Resolved evaluation settings (``interval`` None: no evaluation during training)."""

    interval: int | None = None
    episodes: int = 10
    mode: InteractionMode = InteractionMode.DETERMINISTIC
    video: VideoSettings | None = None
    #: name -> the env config of that extra evaluation (``env`` with the name's overrides merged in)
    envs: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.interval is not None


def _user_set(cfg: DictConfig, key: str, default: Any) -> bool:
    return OmegaConf.select(cfg, key, default=default) != default


def eval_settings(cfg: DictConfig) -> EvalSettings:
    """The evaluation this config asks for (raises ``ValueError`` with a one-line reason on a bad mode)."""
    ev = OmegaConf.select(cfg, "eval", default=None)
    get = (lambda key, default: OmegaConf.select(ev, key, default=default)) if ev is not None else (
        lambda key, default: default)
    notes = []
    interval = get("interval", None)
    episodes = int(get("episodes", 10))
    old_interval = OmegaConf.select(cfg, "trainer.eval_interval", default=None)
    old_episodes = OmegaConf.select(cfg, "trainer.eval_episodes", default=None)
    if old_interval is not None:
        notes.append(DEPRECATED["eval_interval"])
        if interval is None:
            interval = old_interval
    if old_episodes is not None:
        notes.append(DEPRECATED["eval_episodes"])
        if not _user_set(cfg, "eval.episodes", 10):
            episodes = int(old_episodes)
    video = None
    if bool(get("video", False)):
        fps = get("video_fps", None)
        video = VideoSettings(every=int(get("video_every", 1)), episodes=int(get("video_episodes", 1)),
                              fps=None if fps is None else int(fps), max_steps=int(get("video_max_steps", 1000)))
        if interval is None:  # videos during training: ten of them over the budget
            interval = max(1, int(OmegaConf.select(cfg, "trainer.total_frames", default=100_000)) // 10)
    envs = {}
    extra = get("envs", None)
    if extra:
        base = OmegaConf.to_container(cfg, resolve=False)  # the env's interpolations (${env.id}) see the overrides
        base.pop("hydra", None)
        for name, overrides in extra.items():
            merged = OmegaConf.merge(OmegaConf.create(base), {"env": overrides})
            envs[str(name)] = OmegaConf.create(OmegaConf.to_container(merged.env, resolve=True))
    return EvalSettings(interval=None if interval is None else int(interval), episodes=episodes,
                        mode=InteractionMode.parse(str(get("mode", "deterministic"))), video=video, envs=envs,
                        notes=tuple(notes))


_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class EvalConfigError(ValueError):
    """A bad ``eval`` setting; the message is the one line the user sees."""


def _need(value: Any, key: str, ok: Callable[[Any], bool], allowed: str) -> None:
    try:
        good = bool(ok(value))
    except (TypeError, ValueError):
        good = False
    if not good:
        raise EvalConfigError(f"{key}={value!r}: must be {allowed}")


def check_eval(cfg: DictConfig) -> None:
    """Value checks of the ``eval`` group (and the deprecated trainer keys); raises :class:`EvalConfigError`."""
    ev = OmegaConf.select(cfg, "eval", default=None)
    get = (lambda key, default=None: OmegaConf.select(ev, key, default=default)) if ev is not None else (
        lambda key, default=None: default)
    for key in ("trainer.eval_interval", "trainer.eval_episodes"):
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None:
            _need(value, key, lambda v: v >= 1, ">= 1 (deprecated: " + key.replace("trainer.eval_", "eval.") + ")")
    if get("interval") is not None:
        _need(get("interval"), "eval.interval", lambda v: v >= 1, ">= 1 frames (or null: no evaluation)")
    _need(get("episodes", 10), "eval.episodes", lambda v: v >= 1, ">= 1")
    allowed = ", ".join(m.name.lower() for m in InteractionMode)
    _need(get("mode", "deterministic"), "eval.mode", lambda v: InteractionMode.parse(str(v)) is not None,
          f"one of {allowed}")
    _need(get("video_every", 1), "eval.video_every", lambda v: v >= 1, ">= 1 (a video at every Nth evaluation)")
    episodes = int(OmegaConf.select(cfg, "trainer.eval_episodes", default=None) or get("episodes", 10))
    _need(get("video_episodes", 1), "eval.video_episodes", lambda v: 1 <= v <= episodes,
          f">= 1 and at most eval.episodes={episodes} (the videos show evaluation episodes)")
    if get("video_fps") is not None:
        _need(get("video_fps"), "eval.video_fps", lambda v: v >= 1, ">= 1 (or null: the env's render_fps)")
    _need(get("video_max_steps", 1000), "eval.video_max_steps", lambda v: v >= 1, ">= 1 frames per episode")
    envs = get("envs")
    if envs:
        for name, overrides in envs.items():
            _need(str(name), "eval.envs", lambda v: bool(_NAME.match(v)) and v != "video",
                  "a mapping of names (letters, digits, _ . -) to env overrides")
            _need(overrides, f"eval.envs.{name}", lambda v: isinstance(v, DictConfig),
                  "a mapping of env-config keys (e.g. {factory: {kwargs: {...}}}) to their values")
    if bool(get("video", False)):
        import importlib.util

        missing = [m for m in ("imageio", "imageio_ffmpeg") if importlib.util.find_spec(m) is None]
        if missing:
            raise EvalConfigError(f"eval.video=true needs {' and '.join(missing)} (pip install -e '.[video]', "
                                  "which bash scripts/setup.sh does)")
    if str(OmegaConf.select(cfg, "trainer.target_metric", default="train")) == "eval" and \
            not eval_settings(cfg).enabled:
        raise EvalConfigError("trainer.target_metric='eval': needs eval.interval (frames between evaluations)")
