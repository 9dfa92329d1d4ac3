"""When a run writes its checkpoint during training, and what a deterministic run does there.

Why frames as well as seconds: a deterministic run (``deterministic=true``)
may only checkpoint where every run of its config does the same, so its
checkpoints come every ``checkpoint.frames`` frames, never by the clock.
Each one is a *restart point*: the run writes a metric row, the checkpoint,
then builds fresh envs (seeds from (seed, frames)) and re-seeds its RNGs,
exactly what a run resumed from that checkpoint does at its start; so the
resumed run and the one never killed go on identically.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class Checkpointer:
    """Writes the run's state between two trainer steps: every ``interval`` seconds and/or ``every_frames`` frames.

    ``make_state`` builds the checkpoint; ``pause`` (a context manager
    factory, e.g. the collector's ``pause``) quiesces whatever must not move
    while it is taken (a disk replay saved by reference to its files).
    ``interval=None``: no checkpoints by the clock (a deterministic run's).
    """

    def __init__(self, path: Any, interval: float | None, make_state: Callable[[], dict[str, Any]],
                 pause: Callable[[], Any] | None = None, every_frames: int | None = None,
                 start_frames: int = 0) -> None:
        self.path, self.interval, self.make_state, self.pause = path, interval, make_state, pause
        self.every_frames = every_frames
        self.last = time.monotonic()
        self._last_frames = int(start_frames)
        self.saved = 0

    def due(self, now: float, frames: int) -> bool:
        if self.every_frames and frames // self.every_frames > self._last_frames // self.every_frames:
            return True
        return self.interval is not None and now - self.last >= self.interval

    def maybe(self, now: float, frames: int) -> bool:
        """Write the checkpoint if one is due; True when it was written."""
        if not self.due(now, frames):
            return False
        from pipeline.runner.state import save_run_state

        if self.pause is None:
            save_run_state(self.path, self.make_state())
        else:
            with self.pause():
                save_run_state(self.path, self.make_state())
        self.last, self._last_frames = time.monotonic(), frames
        self.saved += 1
        return True


def close_open_windows(nstep: Any, buffer: Any) -> None:
    """The envs were replaced (a restart point, a resume): n-step windows still open end here, into replay."""
    cut = nstep.cut() if nstep is not None else None
    if cut is not None and cut.numel():
        buffer.extend(cut)


def restart_collector(old: Any, make_collector: Callable[[int], Any], trainer: Any, nstep: Any = None,
                      buffer: Any = None) -> Any:
    """A restart point: the old collector stopped, a new one at its frame count serving the trainer's weights."""
    frames = old.frames
    old.shutdown()
    close_open_windows(nstep, buffer)
    new = make_collector(frames)
    new.update_policy_weights_(trainer.model, version=trainer.policy_version)
    return new
