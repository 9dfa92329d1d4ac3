"""Metric sinks: where the rows of :class:`components.metrics.MetricsLogger` go.

Each sink takes the same flat rows (``group/name`` keys plus ``frames`` and
``time``), a final summary and a close. ``jsonl`` is always written (the
report and the resume logic read it); ``tensorboard`` and ``wandb`` are
optional and may fail without stopping the run. ``logger.extra_sinks`` adds
more (``module.Class`` paths, each ``Class(run_dir)`` with this protocol),
run beside TensorBoard and wandb in the sinks process
(:mod:`components.sinks.host`), where none of them can stall training.
"""

from __future__ import annotations

from typing import Any, Protocol

#: Sink names in the order they are opened.
SINK_NAMES = ("jsonl", "tensorboard", "wandb")


class Sink(Protocol):
    """One destination of metric rows."""

    name: str

    def log(self, row: dict[str, Any], frames: int) -> None: ...

    def summary(self, values: dict[str, Any]) -> None: ...

    def close(self, exit_code: int) -> None: ...

    # optional: ``video(tag, path, frames)`` gets each evaluation video (an mp4 in the run directory)
