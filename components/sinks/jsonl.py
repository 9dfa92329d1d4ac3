"""``metrics.jsonl``: one JSON object per line, the run's record of truth.

Rows are appended with one ``write`` of the whole line; a write that fails
(a full disk) is rolled back to the previous length, so the file never
holds half a row, and the error reaches the runner (which ends the run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonLinesSink:
    name = "jsonl"

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._fd: int | None = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)

    def _append(self, row: dict[str, Any]) -> None:
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

    def log(self, row: dict[str, Any], frames: int) -> None:
        self._append(row)

    def summary(self, values: dict[str, Any]) -> None:
        self._append({"summary": values})

    def close(self, exit_code: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
