"""Sweeps: each job reports its point, the sweep reports them all, none is lost silently.

Hydra runs a multirun's jobs through a launcher (one after another, in
joblib worker processes, on SLURM) and may stop at the first failed one or
keep going, depending on the launcher. So every job records its own outcome
on the shared file system, ``<sweep dir>/.jobs/<num>.json`` (written when
it starts and again when it ends, so a job killed on the way shows as
such), prints one status line when it ends, and returns the objective
(``sweep.objective`` from its summary row; NaN when it failed, which the
optuna sweeper counts as a failed trial). The task never exits the process
in a multirun: a failed point must not take the others down.
At the end (:class:`pipeline.runner.hydra_callbacks.SweepReport`) the records
become ``<sweep dir>/sweep.jsonl`` and a table, with the command that
re-runs only the failed points, and the sweep exits 1 if any failed.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from components.atomic_files import write_atomic

JOBS_DIR = ".jobs"


@dataclass
class JobRecord:
    """One sweep point: its overrides, where it ran and how it ended."""

    num: int
    overrides: list[str]
    run_dir: str
    status: str  # started, finished, solved, failed, interrupted
    exit_code: int | None = None
    objective: float | None = None
    reason: str = ""
    seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("finished", "solved")


def record_path(sweep_dir: Path, num: int) -> Path:
    return sweep_dir / JOBS_DIR / f"{num}.json"


def write_record(sweep_dir: Path, record: JobRecord) -> None:
    """Atomically and durably (re)write this job's record (no planted link followed; the umask sets its mode)."""
    path = record_path(sweep_dir, record.num)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(asdict(record)), mode=0o666)


def read_records(sweep_dir: Path) -> list[JobRecord]:
    records = []
    for path in sorted((sweep_dir / JOBS_DIR).glob("*.json"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1):
        try:
            records.append(JobRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return records


def summary_row(run_dir: Path) -> dict[str, Any] | None:
    """The run's final ``summary`` row, if it wrote one."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("summary"), dict):
            return row["summary"]
    return None


def outcome(exit_code: int, run_dir: Path, objective_key: str, error: str | None = None) -> tuple[str, float | None, str]:
    """``(status, objective, reason)`` of a job that returned ``exit_code``."""
    summary = summary_row(run_dir) or {}
    reason = error or str(summary.get("stop_reason", ""))
    value = summary.get(objective_key)
    objective = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    if exit_code == 0:
        return ("solved" if summary.get("solved") else "finished"), objective, reason
    if exit_code == 130:
        return "interrupted", objective, reason
    return "failed", objective, reason or f"exit code {exit_code}"


def status_line(record: JobRecord, objective_key: str) -> str:
    value = "-" if record.objective is None else f"{record.objective:.4g}"
    text = f"[sweep] job {record.num} {record.status}: {' '.join(record.overrides) or '(no overrides)'}; " \
           f"{objective_key}={value}"
    if not record.ok and record.reason:
        text += f"; {record.reason}"
    return text


def report(sweep_dir: Path, objective_key: str, direction: str, argv_prefix: list[str]) -> tuple[str, int]:
    """The summary table (and ``sweep.jsonl``); returns ``(text, number of failed points)``."""
    records = read_records(sweep_dir)
    for record in records:
        if record.status == "started":  # started, never ended: killed with its worker
            record.status, record.reason = "failed", "the job ended without reporting (killed?)"
    lines = []
    write_atomic(sweep_dir / "sweep.jsonl",
                 "".join(json.dumps({**asdict(record), "objective_key": objective_key}) + "\n" for record in records),
                 mode=0o666)
    done = [r for r in records if r.ok and r.objective is not None]
    best = None
    if done:
        pick = max if direction == "maximize" else min
        best = pick(done, key=lambda r: r.objective)  # type: ignore[arg-type, return-value]
    header = f"{'job':>4}  {'status':<11}  {objective_key:>20}  overrides"
    lines += [f"sweep summary ({len(records)} jobs, {objective_key}, {direction}): {sweep_dir / 'sweep.jsonl'}", header]
    for record in records:
        value = "-" if record.objective is None else f"{record.objective:.4g}"
        mark = "  <- best" if record is best else ""
        if not record.ok and record.reason:
            mark = f"  ({record.reason[:100]})"
        lines.append(f"{record.num:>4}  {record.status:<11}  {value:>20}  {' '.join(record.overrides)}{mark}")
    failed = [r for r in records if not r.ok]
    if best is not None:
        lines.append(f"best: job {best.num} ({' '.join(best.overrides)}) with {objective_key}={best.objective:.4g}")
    if failed:
        lines.append(f"{len(failed)} of {len(records)} point(s) failed; re-run only them with:")
        for record in failed:
            lines.append("  " + shlex.join([*argv_prefix, *record.overrides]))
    return "\n".join(lines), len(failed)


def started(sweep_dir: Path, num: int, overrides: list[str], run_dir: Path) -> JobRecord:
    record = JobRecord(num, list(overrides), str(run_dir), "started", seconds=time.time())
    write_record(sweep_dir, record)
    return record


def ended(sweep_dir: Path, record: JobRecord, exit_code: int, objective_key: str, error: str | None = None) -> JobRecord:
    record.status, record.objective, record.reason = outcome(exit_code, Path(record.run_dir), objective_key, error)
    record.exit_code = exit_code
    record.seconds = round(time.time() - (record.seconds or time.time()), 1)
    write_record(sweep_dir, record)
    return record


def cpu_share(cpus: int, concurrent: int) -> int:
    """CPUs one job is sized for when ``concurrent`` jobs share ``cpus``."""
    return max(1, cpus // max(1, concurrent))
