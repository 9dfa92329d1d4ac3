"""Continuing a run in its own directory: ``python -m pipeline resume=<run dir> [overrides]``.

The run's saved overrides (``.hydra/overrides.yaml``) are replayed and the
new ones applied on top, so ``resume=runs/x trainer.total_frames=400000``
is the old run with a larger budget. The runner then restores the state of
``checkpoint.pt`` (model, optimiser, frames, policy version, RNG states,
episode statistics, a disk replay, the wandb run id) and rewinds
``metrics.jsonl`` to the checkpoint's frame, so the resumed rows continue
one curve whose frame column never goes back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.validate import ConfigError

#: Overrides a resume sets itself; saved values of these are not replayed.
_PINNED = ("resume", "hydra.run.dir")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def resume_argv(argv: list[str]) -> list[str]:
    """The command line of a resume: saved overrides, the new ones on top, the run dir pinned.

    Returns ``argv`` unchanged when it has no ``resume=``.

    Examples:
        >>> resume_argv(["seed=1"])
        ['seed=1']
    """
    given = [a for a in argv if _key(a) == "resume"]
    if not given:
        return argv
    value = given[-1].split("=", 1)[1]
    if value in ("", "null", "None"):
        return [a for a in argv if _key(a) != "resume"]
    if any(a in ("-m", "--multirun") for a in argv):
        raise ConfigError(f"resume={value!r}: resumes one run; it cannot be combined with -m/--multirun")
    run_dir = Path(value).expanduser().resolve()
    saved_file = run_dir / ".hydra" / "overrides.yaml"
    if not saved_file.is_file():
        raise ConfigError(f"resume={value!r}: no run to resume there (no .hydra/overrides.yaml)")
    from omegaconf import OmegaConf

    saved = [str(item) for item in OmegaConf.load(saved_file)]
    merged: dict[str, str] = {}
    for item in [*saved, *argv]:
        if item.startswith("-") or _key(item) in _PINNED:
            continue
        merged[_key(item)] = item
    flags = [a for a in argv if a.startswith("-")]
    return [*flags, *merged.values(), f"resume={run_dir}", f"hydra.run.dir={run_dir}"]


def rewind_metrics(path: Path, frames: int) -> int:
    """Keep the rows of ``path`` logged at or before ``frames``; drop later rows and summaries.

    Rows after the checkpoint describe training that the resumed run redoes;
    a summary row belongs to the end of a run that goes on. The file is
    replaced atomically. Returns the number of rows kept.
    """
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a row cut short by a kill
        if "summary" in row or int(row.get("frames", 0)) > frames:
            continue
        kept.append(line)
    tmp = path.with_name(f".{path.name}.rewind")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(kept)
