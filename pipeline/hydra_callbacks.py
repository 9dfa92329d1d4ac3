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


class SweepReport(Callback):
    """A multirun's bookends: the optuna direction from ``sweep.direction``; the summary at the end.

    Start: with ``hydra/sweeper=optuna`` and no ``hydra.sweeper.direction``
    on the command line, the study's direction follows ``sweep.direction``
    (optuna's own default, minimize, would minimise the return). End: every
    job's record (:mod:`pipeline.sweep`) becomes a table on stdout and
    ``<sweep dir>/sweep.jsonl``, with the best point, the commands that re-run
    the failed ones, and exit code 1 when any failed.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        import logging

        from omegaconf import open_dict, read_write

        logging.getLogger("alembic").setLevel(logging.WARNING)  # optuna's storage: a page of plugin lines
        sweeper = config.hydra.get("sweeper", {})
        if "optuna" not in str(sweeper.get("_target_", "")).lower():
            return
        given = [str(o) for o in config.hydra.overrides.get("hydra", [])]
        if any(o.split("=", 1)[0].lstrip("+~") == "hydra.sweeper.direction" for o in given):
            return
        direction = str(config.sweep.direction)
        with read_write(config), open_dict(config):
            config.hydra.sweeper.direction = direction
        print(f"[sweep] optuna {direction}s {config.sweep.objective} (sweep.direction; "
              "hydra.sweeper.direction=... overrides it)", flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from pipeline.sweep import report

        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        text, failed = report(sweep_dir, str(config.sweep.objective), str(config.sweep.direction),
                              ["python", "-m", "pipeline"])
        print(text, flush=True)
        if failed:
            sys.exit(1)
