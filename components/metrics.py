"""Metric sinks: a JSON-lines file in the run directory, wandb, the console.

Every logged row is a flat dict of numbers keyed ``group/name``
(``train/policy_loss``, ``server/avg_batch_size``, ...) plus ``frames`` and
``time``. The JSON-lines file is flushed row by row, so a crashed run keeps
everything it logged; it is what tests and scripts read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

KINDS = ("wandb", "jsonl", "none")


def _clean(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, str)):
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f if math.isfinite(f) else None


class _JsonLines:
    """An append-only file of whole lines: a write that fails (a full disk) leaves no partial line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)

    def append(self, row: Mapping[str, Any]) -> None:
        if self._fd is None:
            return
        data = (json.dumps(row) + "\n").encode("utf-8")
        size = os.fstat(self._fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as err:
            try:
                os.ftruncate(self._fd, size)
            except OSError:
                pass
            raise OSError(err.errno, f"{err.strerror} (writing {self.path})") from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class MetricsLogger:
    """Writes metric rows to the sinks ``kind`` selects.

    ``kind="wandb"`` writes ``metrics.jsonl`` and a wandb run whose files
    live in ``<run_dir>/wandb`` (offline unless ``mode`` or ``WANDB_MODE``
    says otherwise); ``"jsonl"`` only the file; ``"none"`` nothing (the
    console still shows progress).

    Examples:
        >>> import tempfile, json
        >>> d = Path(tempfile.mkdtemp())
        >>> log = MetricsLogger(d, kind="jsonl")
        >>> log.log({"train/loss": 0.5}, frames=100)
        >>> log.close()
        >>> json.loads((d / "metrics.jsonl").read_text())["train/loss"]
        0.5
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        kind: str = "jsonl",
        interval: float = 5.0,
        project: str = "rlpipeline",
        entity: str | None = None,
        group: str | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
        mode: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        resume_id: str | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"logger kind {kind!r} is not one of {KINDS}")
        self.kind = kind
        self.interval = interval
        self.run_dir = Path(run_dir)
        self._file: _JsonLines | None = None
        self._wandb_run = None
        if kind in ("wandb", "jsonl"):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = _JsonLines(self.run_dir / "metrics.jsonl")
        if kind == "wandb":
            import wandb

            self._wandb_run = wandb.init(
                project=project,
                entity=entity,
                group=group,
                name=name,
                tags=list(tags or []),
                dir=str(self.run_dir),
                mode=mode or os.environ.get("WANDB_MODE") or "offline",
                config=dict(run_config or {}),
                id=resume_id,
                resume="allow" if resume_id else None,
                settings=wandb.Settings(silent=True, console="off"),
            )

    @property
    def wandb_id(self) -> str | None:
        """The wandb run's id (what a resumed run continues), None without wandb."""
        return self._wandb_run.id if self._wandb_run is not None else None

    @property
    def wandb_dir(self) -> Path | None:
        return Path(self._wandb_run.dir).parent if self._wandb_run is not None else None

    def log(self, metrics: Mapping[str, Any], *, frames: int) -> None:
        row = {"frames": int(frames), **{k: _clean(v) for k, v in metrics.items()}}
        if self._file is not None:
            self._file.append(row)
        if self._wandb_run is not None:
            numeric = {k: v for k, v in row.items() if isinstance(v, (int, float))}
            self._wandb_run.log(numeric, step=int(frames))

    def summary(self, values: Mapping[str, Any]) -> None:
        """Final values (wandb run summary; a last ``summary`` row in the file)."""
        clean = {k: _clean(v) for k, v in values.items()}
        if self._file is not None:
            self._file.append({"summary": clean})
        if self._wandb_run is not None:
            self._wandb_run.summary.update(clean)

    def close(self, exit_code: int = 0) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            run.finish(exit_code=exit_code)
