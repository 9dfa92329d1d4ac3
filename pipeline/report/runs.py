"""Finding runs under a path and reading what they wrote, without touching anything.

A run directory is one with a ``metrics.jsonl`` (or a ``.run.lock`` of a run
that has not logged yet). Its rows are read line by line; a half-written
last line (a run still writing, or killed mid-write) is skipped. The status
comes from the summary row when there is one, else from the lock: a live
owner means the run is still going; a dead one means it ended without a
summary (killed), which counts as failed.
"""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Directories inside a run that never hold runs themselves.
_SKIP = {"wandb", "tb", "replay", ".hydra", "__pycache__"}
STATUSES = ("running", "finished", "solved", "failed", "interrupted")


@dataclass
class RunRecord:
    """One run as the report shows it."""

    path: Path
    name: str
    overrides: dict[str, str]
    rows: list[dict[str, Any]]
    summary: dict[str, Any] | None
    status: str
    stop_reason: str
    skipped_lines: int = 0
    config: dict[str, Any] = field(default_factory=dict)

    def series(self, key: str, x: str = "frames") -> tuple[list[float], list[float]]:
        """``(xs, ys)`` of the rows that have both ``x`` and ``key`` as finite numbers."""
        xs, ys = [], []
        for row in self.rows:
            a, b = row.get(x), row.get(key)
            if _number(a) and _number(b):
                xs.append(float(a))
                ys.append(float(b))
        return xs, ys

    def has(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for row in self.rows for k in row)

    def last(self, key: str) -> float | None:
        for row in reversed(self.rows):
            if _number(row.get(key)):
                return float(row[key])
        return None

    @property
    def frames(self) -> int | None:
        if self.summary and _number(self.summary.get("frames")):
            return int(self.summary["frames"])
        value = self.last("frames")
        return None if value is None else int(value)

    @property
    def wall_time_s(self) -> float | None:
        if self.summary and _number(self.summary.get("wall_time_s")):
            return float(self.summary["wall_time_s"])
        return self.last("time")

    @property
    def frames_per_s(self) -> float | None:
        frames, wall = self.frames, self.wall_time_s
        return frames / wall if frames and wall else None

    @property
    def final_return(self) -> float | None:
        if self.summary and _number(self.summary.get("episode/return_mean")):
            return float(self.summary["episode/return_mean"])
        return self.last("episode/return_mean")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def find_run_dirs(root: Path) -> list[Path]:
    """Run directories at or below ``root``, sorted by path."""
    found = []
    for current, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP)
        if "metrics.jsonl" in files or ".run.lock" in files:
            found.append(Path(current))
    return sorted(found)


def read_rows(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int]:
    """Metric rows, the summary (or None) and how many lines could not be read."""
    rows: list[dict[str, Any]] = []
    summary = None
    bad = 0
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return rows, None, 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(row, dict):
            bad += 1
        elif "summary" in row and isinstance(row["summary"], dict):
            summary = row["summary"]
        else:
            rows.append(row)
    return rows, summary, bad


def _owner_alive(lock: Path) -> bool:
    try:
        owner = json.loads(lock.read_text())
        pid, host = int(owner.get("pid", -1)), owner.get("host")
    except (OSError, ValueError, TypeError):
        return False
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def status_of(summary: dict[str, Any] | None, lock: Path) -> tuple[str, str]:
    """``(status, stop reason)`` of a run."""
    if summary is not None:
        reason = str(summary.get("stop_reason", ""))
        if reason == "target_return" or summary.get("solved"):
            return "solved", reason
        if reason.startswith("failed"):
            return "failed", reason
        if reason.startswith("interrupted"):
            return "interrupted", reason
        return "finished", reason
    if lock.exists() and _owner_alive(lock):
        return "running", ""
    return "failed", "ended without a summary (killed?)"


def _read_overrides(run_dir: Path) -> dict[str, str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        from omegaconf import OmegaConf

        items = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # noqa: BLE001 - a missing or odd file: no overrides shown
        return {}
    out = {}
    for item in items if isinstance(items, list) else []:
        key, sep, value = str(item).partition("=")
        key = key.lstrip("+~")
        if sep and not key.startswith("hydra."):
            out[key] = value
    return out


def load_run(run_dir: Path, root: Path) -> RunRecord:
    rows, summary, bad = read_rows(run_dir / "metrics.jsonl")
    status, reason = status_of(summary, run_dir / ".run.lock")
    try:
        name = str(run_dir.relative_to(root)) if run_dir != root else run_dir.name
    except ValueError:
        name = run_dir.name
    return RunRecord(run_dir, name or run_dir.name, _read_overrides(run_dir), rows, summary, status, reason, bad)


def load_runs(root: Path) -> list[RunRecord]:
    return [load_run(d, root) for d in find_run_dirs(root)]


def swept_keys(runs: list[RunRecord]) -> list[str]:
    """Override keys whose values differ between runs (what a sweep varied)."""
    keys: dict[str, set[str]] = {}
    for run in runs:
        for key in run.overrides:
            keys.setdefault(key, set())
    for key in keys:
        keys[key] = {run.overrides.get(key, "(default)") for run in runs}
    return sorted(k for k, values in keys.items() if len(values) > 1)
