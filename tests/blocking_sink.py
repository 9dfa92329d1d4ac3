"""Sinks that stop answering, for ``logger.extra_sinks=[tests.blocking_sink.BlockingSink]``.

A wandb service that hangs or a network file system that blocks every write
looks, from the run, like a sink whose calls never return: that is what
these do, from their first row (``log``), and in ``summary`` and ``close``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any


class BlockingSink:
    """Opens, then blocks forever in every call (its process can only be killed)."""

    name = "blocking"

    def __init__(self, run_dir: Path) -> None:
        self._never = threading.Event()

    def log(self, row: dict[str, Any], frames: int) -> None:
        self._never.wait()

    def summary(self, values: dict[str, Any]) -> None:
        self._never.wait()

    def close(self, exit_code: int) -> None:
        self._never.wait()


class RecordingSink:
    """Writes what it gets to ``<run dir>/recorded.jsonl`` (one JSON line per call), so a test can read it."""

    name = "recording"

    def __init__(self, run_dir: Path) -> None:
        self._file = open(Path(run_dir) / "recorded.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close

    def _write(self, kind: str, value: Any) -> None:
        import json

        self._file.write(json.dumps({kind: value}) + "\n")

    def log(self, row: dict[str, Any], frames: int) -> None:
        self._write("row", row)

    def summary(self, values: dict[str, Any]) -> None:
        self._write("summary", values)

    def close(self, exit_code: int) -> None:
        self._write("close", exit_code)
        self._file.close()
