"""Continuing a run in its own directory: ``python -m pipeline resume=<run dir> [overrides]``.

The run's saved overrides (``.hydra/overrides.yaml``) are replayed and the
new ones applied on top, so ``resume=runs/x trainer.total_frames=400000``
is the old run with a larger budget. The runner then restores the state of
``checkpoint.pt`` (model, optimiser, frames, policy version, RNG states,
episode statistics, a disk replay, the wandb run id) and rewinds
``metrics.jsonl`` to the checkpoint's frame, so the resumed rows continue
one curve whose frame column never goes back.

A run directory is data someone may have sent, downloaded or left in a
shared place, so a resume takes *data* from it, never code:

- ``checkpoint.pt`` is checked first, before anything is composed or built
  (:func:`pipeline.runner.state.read_run_state`: a regular file that loads with
  ``weights_only=True`` and holds what a run saves); otherwise one line and
  exit 2, with nothing written into the directory;
- each saved override is vetted (:mod:`pipeline.runner.saved_overrides` lists
  what is refused) and refused when it could import or call code. One line
  names every refused item and the command that restates them; an item the
  user restates on the command line is the user's, and accepted;
- the config stored *inside* ``checkpoint.pt`` is never used to rebuild
  anything (the runner composes from the overrides; the checkpoint only
  restores state), so it cannot smuggle a target either.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from pipeline.runner.saved_overrides import (hydra_quote, override_key, parse, project_configs, read_saved_overrides,
                                      refusal)
from pipeline.plan.validate import ConfigError

#: Overrides a resume sets itself; saved values of these are not replayed.
_PINNED = ("resume", "hydra.run.dir")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _arg_key(item: str) -> str:
    """The key an argument sets, as Hydra reads it (``+a.b=1`` and ``a.b=2`` set the same key)."""
    override = parse(item)
    return override_key(override) if override is not None else _key(item)


def _show(item: str) -> str:
    """``item`` as the user would type it in a shell (control characters escaped: one line)."""
    return shlex.quote(item) if item.isprintable() else repr(item)


def _resume_value(item: str) -> str:
    """The path ``resume=...`` names: the text as typed when that path exists, else the value as Hydra reads it.

    ``resume=runs/lr=0.1,seed=1`` (Hydra would read a sweep, or fail) is a
    directory as typed; ``resume="'runs/a b'"`` is unquoted as Hydra would.
    """
    raw = item.split("=", 1)[1]
    if raw and os.path.isdir(os.path.expanduser(raw)):
        return raw
    override = parse(item.lstrip("+~"))
    if override is not None and not override.is_sweep_override():
        value = override.value()
        if isinstance(value, str):
            return value
        if value is None:
            return ""
    return raw


def resume_argv(argv: list[str]) -> list[str]:
    """The command line of a resume: saved overrides (data only), the new ones on top, the run dir pinned.

    Returns ``argv`` unchanged when it has no ``resume=``. Raises
    :class:`ConfigError` (one line) for a directory without a loadable
    checkpoint, an unreadable overrides file, or saved items that would run
    code and are not restated in ``argv`` (see the module docstring).

    Examples:
        >>> resume_argv(["seed=1"])
        ['seed=1']
    """
    given = [a for a in argv if not a.startswith("-") and _key(a) == "resume"]
    if not given:
        return argv
    value = _resume_value(given[-1])
    if value in ("", "null", "None"):
        return [a for a in argv if a.startswith("-") or _key(a) != "resume"]
    where = f"resume={value!r}"
    if any(a in ("-m", "--multirun") for a in argv):
        raise ConfigError(f"{where}: resumes one run; it cannot be combined with -m/--multirun")
    run_dir = Path(value).expanduser().resolve()
    if not run_dir.is_dir():
        raise ConfigError(f"{where}: no run to resume there (no such directory)")
    from pipeline.runner.state import CheckpointError, read_run_state

    try:
        read_run_state(run_dir / "checkpoint.pt")
    except CheckpointError as err:
        raise ConfigError(f"{where}: cannot resume: {err}; nothing was changed") from None
    metrics = run_dir / "metrics.jsonl"
    if os.path.lexists(metrics) and not metrics.is_file():
        raise ConfigError(f"{where}: metrics.jsonl is not a regular file; move it away to resume")
    saved = read_saved_overrides(run_dir / ".hydra" / "overrides.yaml", where)

    project = project_configs()
    user_keys = {_arg_key(a) for a in argv if not a.startswith("-")}
    merged: dict[str, str] = {}
    refused: list[tuple[str, str]] = []
    for item in saved:
        if item.startswith("-") or _key(item) in _PINNED:
            continue  # flags (-m, --config-dir) are never taken from a run directory; the pinned are set below
        override = parse(item)
        if override is None:
            raise ConfigError(f"{where}: .hydra/overrides.yaml holds {item!r}, which is not an override "
                              "Hydra's grammar parses")
        key = override_key(override)
        if key in _PINNED:
            continue
        if override.is_sweep_override():
            raise ConfigError(f"{where}: .hydra/overrides.yaml holds the sweep {item!r}; a resume continues "
                              "one run (give that key one value on the command line)")
        if key in user_keys:
            merged[key] = item  # its place in the order; the user's item replaces it below
            continue
        reason = refusal(override, project)
        if reason is not None:
            refused.append((item, reason))
            continue
        merged[key] = item
    if refused:
        listed = "; ".join(f"{_show(item)} ({reason})" for item, reason in refused)
        restate = " ".join(_show(item) for item, _ in refused)
        raise ConfigError(
            f"{where}: refused {len(refused)} item(s) of its .hydra/overrides.yaml that would run code: {listed}; "
            f"restate them on the command line to accept them: python -m pipeline "
            f"{_show('resume=' + str(run_dir))} {restate}")
    for item in argv:
        if item.startswith("-"):
            continue
        key = _arg_key(item)
        if key in _PINNED:
            continue
        merged[key] = item  # in the saved item's place, or after them
    flags = [a for a in argv if a.startswith("-")]
    quoted = hydra_quote(str(run_dir))
    return [*flags, *merged.values(), f"resume={quoted}", f"hydra.run.dir={quoted}"]


def rewind_metrics(path: Path, frames: int) -> int:
    """Keep the rows of ``path`` logged at or before ``frames``; drop later rows and summaries.

    Rows after the checkpoint describe training that the resumed run redoes;
    a summary row belongs to the end of a run that goes on. A line that is
    not a JSON object (a damaged row, or the last row cut short by a kill)
    is not dropped: it is appended, as it was, to ``<path>.damaged``
    (``metrics.jsonl.damaged``) beside the file, so nothing a run logged is
    lost silently. Both files are written atomically
    (:func:`components.atomic_files.write_atomic`). Returns the number of
    rows kept.
    """
    from components.atomic_files import write_atomic

    if not os.path.lexists(path):
        return 0
    if not path.is_file():
        raise ConfigError(f"{path}: not a regular file; move it away to resume")
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({err.strerror or err}); move it away to resume") from None
    kept: list[str] = []
    damaged: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            row = None
        if not isinstance(row, dict):
            damaged.append(line)
            continue
        if "summary" in row:
            continue
        try:
            logged_at = int(row.get("frames", 0))
        except (TypeError, ValueError, OverflowError):
            damaged.append(line)
            continue
        if logged_at > frames:
            continue
        kept.append(line)
    if damaged:
        side = path.with_name(path.name + ".damaged")
        before = side.read_bytes() if side.is_file() else b""
        added = "".join(line + "\n" for line in damaged).encode("utf-8", errors="surrogateescape")
        write_atomic(side, before + added)
    write_atomic(path, "".join(line + "\n" for line in kept).encode("utf-8", errors="surrogateescape"))
    return len(kept)
