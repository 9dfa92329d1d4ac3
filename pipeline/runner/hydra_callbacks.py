"""Hydra callbacks: checks that must happen before Hydra itself touches the run directory."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def _apply_mode(config: DictConfig) -> None:
    """``rundir.mode``'s umask, before Hydra creates any directory (pipeline/runner/rundir.py says why)."""
    from pipeline.runner.rundir import apply_mode
    from pipeline.plan.validate import ConfigError

    try:
        apply_mode(str(config.get("rundir", {}).get("mode", "private")))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


class RunDirCheck(Callback):
    """Refuse an unusable ``hydra.run.dir`` with one line (exit 2) before Hydra creates it.

    Hydra makes the run directory itself, and a path it cannot create would
    end in its traceback. Here the process umask is set for ``rundir.mode``
    (so the directory is created 0700 by default) and the path is created
    first; a failure is a config error like any other. A multirun gets the
    umask before its sweep directory exists.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from components.atomic_files import create_exclusive

        _apply_mode(config)
        raw = config.hydra.run.dir
        try:
            run_dir = Path(str(raw))
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / f".write-test-{os.getpid()}-{secrets.token_hex(4)}"
            create_exclusive(probe, b"ok")  # O_EXCL | O_NOFOLLOW: a planted link is refused, not followed
            probe.unlink()
        except OSError as err:
            print(f"config error: hydra.run.dir={str(raw)!r}: cannot write there ({err.strerror or err})",
                  file=sys.stderr, flush=True)
            sys.exit(2)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _apply_mode(config)


def _ray_temp_dirs() -> list[Path]:
    return [Path(os.environ.get("RAY_TMPDIR") or "/tmp") / "ray", Path("/tmp") / "ray"]


def local_ray_defaults(config: DictConfig) -> bool:
    """With ``hydra/launcher=ray`` about to start a local cluster: bind it to 127.0.0.1, no dashboard.

    The launcher calls ``ray.init(**hydra.launcher.ray.init)``; without an
    address and without a cluster to join, that starts a cluster whose GCS,
    raylets and dashboard listen on the machine's external address: anyone
    on the network could submit jobs (Ray runs any code it is sent). So,
    only then, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray's own switch:
    every process advertises and binds 127.0.0.1; read when ray is imported,
    which the launcher does later) and ``include_dashboard=false`` unless the
    user set it. An address the user gives (``init.address``,
    ``RAY_ADDRESS``, a cluster ``ray start`` left on this machine) is the
    user's cluster and left alone. Returns whether it applied.
    """
    from omegaconf import open_dict, read_write

    launcher = config.hydra.get("launcher") or {}
    if "hydra_ray_launcher.ray_launcher.RayLauncher" not in str(launcher.get("_target_", "")):
        return False
    init = (launcher.get("ray") or {}).get("init")
    address = None if init is None else init.get("address")
    if address not in (None, "", "local"):
        return False
    if address != "local" and (os.environ.get("RAY_ADDRESS")
                               or any((d / "ray_current_cluster").exists() for d in _ray_temp_dirs())):
        return False  # ray.init() would join that cluster: the user's
    with read_write(config), open_dict(config):
        if config.hydra.launcher.ray.get("init") is None:
            config.hydra.launcher.ray.init = {}
        if "include_dashboard" not in config.hydra.launcher.ray.init:
            config.hydra.launcher.ray.init.include_dashboard = False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    return True


class SweepReport(Callback):
    """A multirun's bookends: the optuna direction from ``sweep.direction``; the summary at the end.

    Start: with ``hydra/sweeper=optuna`` and no ``hydra.sweeper.direction``
    on the command line, the study's direction follows ``sweep.direction``
    (optuna's own default, minimize, would minimise the return). End: every
    job's record (:mod:`pipeline.runner.sweep`) becomes a table on stdout and
    ``<sweep dir>/sweep.jsonl``, with the best point, the commands that re-run
    the failed ones, and exit code 1 when any failed.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        import logging

        from omegaconf import open_dict, read_write

        logging.getLogger("alembic").setLevel(logging.WARNING)  # optuna's storage: a page of plugin lines
        local_ray_defaults(config)
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
        from pipeline.runner.sweep import report

        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        text, failed = report(sweep_dir, str(config.sweep.objective), str(config.sweep.direction),
                              ["python", "-m", "pipeline"])
        print(text, flush=True)
        if failed:
            sys.exit(1)
