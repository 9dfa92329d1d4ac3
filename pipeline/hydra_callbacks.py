"""Hydra callbacks: checks that must happen before Hydra itself touches the run directory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class RunDirCheck(Callback):
    """Refuse an unusable ``hydra.run.dir`` with one line (exit 2) before Hydra creates it.

    Hydra makes the run directory itself, and a path it cannot create would
    end in its traceback. Here the path is resolved and created first; a
    failure is a config error like any other.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        raw = config.hydra.run.dir
        try:
            run_dir = Path(str(raw))
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write-test"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as err:
            print(f"config error: hydra.run.dir={str(raw)!r}: cannot write there ({err.strerror or err})",
                  file=sys.stderr, flush=True)
            sys.exit(2)
