"""TensorBoard event files in ``<run dir>/tb``: the same keys as the JSONL rows.

Scalars are logged against frames; the resolved config goes in as text at
the start; at the end ``hparams`` summaries (the run's overrides against
its final metrics) are written into the same event stream, so
``tensorboard --logdir <sweep dir>`` compares a sweep's points in its
HParams tab (``SummaryWriter.add_hparams`` would open a second run
directory per call instead).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Final-summary keys shown as HParams metrics (under ``hparam/``).
HPARAM_METRICS = ("episode/return_mean", "wall_time_s", "frames", "collector/frames_per_s")


def _hparam_value(value: Any) -> bool | int | float | str:
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, run_dir: Path, *, config_text: str | None = None,
                 hparams: dict[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tb"
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)
        self._hparams = {k: _hparam_value(v) for k, v in (hparams or {}).items()}
        self._last: dict[str, float] = {}
        if config_text:
            # Markdown code block: TensorBoard's text plugin renders markdown.
            self._writer.add_text("config", "```\n" + config_text + "\n```", 0)

    def log(self, row: dict[str, Any], frames: int) -> None:
        for key, value in row.items():
            if key == "frames" or isinstance(value, (str, bool)) or value is None:
                continue
            self._writer.add_scalar(key, value, frames)
            self._last[key] = float(value)
        self._writer.flush()

    def summary(self, values: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        metrics = {f"hparam/{k}": float(v) for k, v in {**self._last, **values}.items()
                   if k in HPARAM_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not metrics:
            return
        experiment, start, end = hparams(self._hparams or {"run": "default"}, metrics)
        writer = self._writer.file_writer
        for summary in (experiment, start, end):
            writer.add_summary(summary)
        step = int(values.get("frames", 0) or 0)
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self, exit_code: int) -> None:
        self._writer.close()
