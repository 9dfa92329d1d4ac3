"""Finding runs under a path and reading what they wrote, without touching anything.

A run directory is one with a ``metrics.jsonl`` (or a ``.run.lock`` of a run
that has not logged yet). Its rows are read line by line; a half-written
last line (a run still writing, or killed mid-write) is skipped. The status
comes from the summary row when there is one, else from the lock: a live
owner means the run is still going; a dead one means it ended without a
summary (killed), which counts as failed.

Whatever a run directory holds, reading it ends in a record: a FIFO, device
or socket under a run's file names is skipped without being opened (see
:mod:`pipeline.report.files`), a line longer than ``MAX_LINE`` or nested
deeper than ``MAX_DEPTH`` is a damaged line, a lock that is not a JSON object
names no owner, and a file that cannot be read becomes a line in
``RunRecord.problems`` that the page shows. One odd run never costs the
report of all the others.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.report.videos import find_videos
from pipeline.report.files import NotRegular, iter_lines, open_regular, read_capped

#: Directories inside a run that never hold runs themselves.
_SKIP = {"wandb", "tb", "replay", ".hydra", "__pycache__"}
STATUSES = ("running", "finished", "solved", "failed", "interrupted", "unreadable")
#: A metrics row longer than this is damaged (rows are a few KB; a longer line is garbage or an attack).
MAX_LINE = 1 << 20
#: Deeper JSON than this is damaged (rows are flat; ``json`` recurses once per level).
MAX_DEPTH = 64
#: Lock and overrides files are small; a larger one is not read.
MAX_SMALL_FILE = 1 << 20
#: A string (skipped whole) or one bracket: what :func:`too_deep` counts.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


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
    #: One line per odd file of the run ("metrics.jsonl: a FIFO, skipped"), shown in the page.
    problems: list[str] = field(default_factory=list)
    #: (frames, path under the report's root) of each evaluation video (pipeline.report.videos)
    videos: list[tuple[int, str]] = field(default_factory=list)

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
    """A finite int or float that converts to a float (a 400-digit int from a crafted row does not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    return math.isfinite(value)


def find_run_dirs(root: Path) -> list[Path]:
    """Run directories at or below ``root``, sorted by path (symlinked directories are not entered)."""
    found = []
    for current, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP)
        if "metrics.jsonl" in files or ".run.lock" in files:
            found.append(Path(current))
    return sorted(found)


def too_deep(line: str, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text nests arrays/objects deeper than ``limit``.

    Checked before ``json.loads``, which recurses once per level (a line of
    100,000 ``[`` is a ``RecursionError``) and hands back structures that
    ``str()`` or plotly would recurse into again. Counting brackets is C-speed;
    the exact scan (strings skipped) runs only when there are many of them.
    """
    if line.count("[") + line.count("{") <= limit:
        return False
    depth = 0
    for match in _TOKENS.finditer(line):
        token = match.group(0)
        if token in ("[", "{"):
            depth += 1
            if depth > limit:
                return True
        elif token in ("]", "}"):
            depth -= 1
    return False


def _problem(name: str, err: BaseException) -> str:
    if isinstance(err, NotRegular):
        return f"{name}: {err}"
    if isinstance(err, OSError):
        return f"{name}: unreadable ({err.strerror or err})"
    return f"{name}: unreadable ({err})"


def read_rows(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int]:
    """Metric rows, the summary (or None) and how many lines could not be read."""
    rows, summary, bad, _ = read_metrics(path)
    return rows, summary, bad


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int, list[str]]:
    """Metric rows, the summary (or None), how many lines could not be read, and what was wrong with the file.

    A line that is not JSON, not an object, longer than ``MAX_LINE`` bytes or
    nested deeper than ``MAX_DEPTH`` is skipped and counted; a file that is
    missing, not a regular file or cannot be opened gives no rows and one
    problem line (which the page shows next to the run).
    """
    rows: list[dict[str, Any]] = []
    summary = None
    bad = 0
    reasons: dict[str, int] = {}
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return rows, None, 0, []
    except OSError as err:
        return rows, None, 0, [_problem(path.name, err)]
    try:
        for raw in iter_lines(fd, MAX_LINE):
            if raw is None:
                bad += 1
                reasons["longer than 1 MB"] = reasons.get("longer than 1 MB", 0) + 1
                continue
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            if too_deep(line):
                bad += 1
                reasons["nested too deeply"] = reasons.get("nested too deeply", 0) + 1
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                bad += 1
                continue
            if not isinstance(row, dict):
                bad += 1
            elif "summary" in row and isinstance(row["summary"], dict):
                summary = row["summary"]
            else:
                rows.append(row)
    except OSError as err:  # an I/O error mid-file (a dying disk, a network mount gone)
        return rows, summary, bad, [_problem(path.name, err)]
    problems = [f"{path.name}: {n} damaged line(s) skipped ({why})" for why, n in reasons.items()]
    return rows, summary, bad, problems


def read_lock(lock: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The lock's owner record (or None) and what is wrong with the file (or None); missing: ``(None, None)``."""
    try:
        data = read_capped(lock, MAX_SMALL_FILE)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as err:
        return None, _problem(lock.name, err)
    try:
        text = data.decode("utf-8")
        owner = None if too_deep(text) else json.loads(text)
    except (ValueError, RecursionError):
        return None, f"{lock.name}: not JSON, ignored"
    if not isinstance(owner, dict):
        return None, f"{lock.name}: not a JSON object, ignored"
    return owner, None


def _owner_alive(owner: dict[str, Any] | None) -> bool:
    """Whether the lock names a live process on this host (a pid that is not a positive int names none)."""
    if owner is None:
        return False
    pid, host = owner.get("pid"), owner.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not isinstance(host, str):
        return False
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    return True


def _running(lock: Path, owner: dict[str, Any] | None) -> bool:
    """Whether the lock's run is alive: its ``flock`` is held (a lock since flock claims), else its pid lives.

    A lock written by a flock claim (``"v"`` in it) stays as a record after
    the run; only the kernel's lock tells whether its run still holds it (a
    pid may have been reused). An older pid-file lock has only its pid.
    """
    if owner is None or "ended" in owner:
        return False
    if "v" in owner:
        from pipeline.runner.run_lock import lock_held

        return lock_held(lock)
    return _owner_alive(owner)


def status_of(summary: dict[str, Any] | None, lock: Path, owner: dict[str, Any] | None = None) -> tuple[str, str]:
    """``(status, stop reason)`` of a run (``owner``: the record already read from ``lock``, if any)."""
    if summary is not None:
        reason = str(summary.get("stop_reason", ""))[:2000]
        if reason == "target_return" or summary.get("solved"):
            return "solved", reason
        if reason.startswith("failed"):
            return "failed", reason
        if reason.startswith("interrupted"):
            return "interrupted", reason
        return "finished", reason
    if owner is None:
        owner = read_lock(lock)[0]
    if _running(lock, owner):
        return "running", ""
    return "failed", "ended without a summary (killed?)"


def _read_overrides(run_dir: Path) -> tuple[dict[str, str], str | None]:
    """The run's ``key=value`` overrides, and what is wrong with the file (or None)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        data = read_capped(path, MAX_SMALL_FILE)
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as err:
        return {}, _problem(".hydra/overrides.yaml", err)
    try:
        import yaml

        items = yaml.safe_load(data.decode("utf-8", errors="replace"))
    except Exception:  # noqa: BLE001 - invalid YAML, too deep (RecursionError): no overrides shown
        return {}, ".hydra/overrides.yaml: not valid YAML, ignored"
    if items is None:
        return {}, None
    if not isinstance(items, list):
        return {}, ".hydra/overrides.yaml: not a YAML list, ignored"
    out = {}
    for item in items:
        if not isinstance(item, (str, int, float, bool)):
            continue  # a nested (or alias-bombed) item is no override
        key, sep, value = str(item).partition("=")
        key = key.lstrip("+~")
        if sep and not key.startswith("hydra."):
            out[key] = value
    return out, None


def load_run(run_dir: Path, root: Path) -> RunRecord:
    """One run as the page shows it; whatever its files hold, a record (odd files become ``problems``)."""
    try:
        name = str(run_dir.relative_to(root)) if run_dir != root else run_dir.name
    except ValueError:
        name = run_dir.name
    name = name or run_dir.name
    try:
        rows, summary, bad, problems = read_metrics(run_dir / "metrics.jsonl")
        owner, lock_problem = read_lock(run_dir / ".run.lock")
        overrides, overrides_problem = _read_overrides(run_dir)
        problems += [p for p in (lock_problem, overrides_problem) if p]
        status, reason = status_of(summary, run_dir / ".run.lock", owner)
        if status == "failed" and summary is None and any(p.startswith("metrics.jsonl: ") and "damaged" not in p
                                                          for p in problems):
            status, reason = "unreadable", "metrics.jsonl could not be read"
        relative = "" if run_dir == root else run_dir.relative_to(root).as_posix()
        return RunRecord(run_dir, name, overrides, rows, summary, status, reason, bad, problems=problems,
                         videos=find_videos(run_dir, relative))
    except Exception as err:  # noqa: BLE001 - one odd run is a row in the page, not a crashed report
        return RunRecord(run_dir, name, {}, [], None, "unreadable", "could not be read",
                         problems=[f"{type(err).__name__}: {err}"[:500]])


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
