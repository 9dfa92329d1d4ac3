"""Spawned contenders for a run directory: a module of their own, so a child imports the run lock alone.

A spawned child imports the module its target lives in. From a test module
that also imports the planner, each child paid for torch and tensordict too
(seconds each): six of them on two busy CPUs once took 68 s to answer a 60-s
wait.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.plan.validate import ConfigError
from pipeline.runner.run_lock import claim_run_dir


def claim_and_hold(path: str, results: Any, release: Any) -> None:
    """Claim ``path``; put ``won`` or ``refused`` on ``results``; a winner holds it until ``release`` is set."""
    try:
        claim = claim_run_dir(Path(path))
    except ConfigError:
        results.put("refused")
        return
    results.put("won")
    release.wait(60)  # a run holds its directory for its whole life
    claim.release()
