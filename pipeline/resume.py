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
  (:func:`pipeline.state.read_run_state`: a regular file that loads with
  ``weights_only=True`` and holds what a run saves); otherwise one line and
  exit 2, with nothing written into the directory;
- each saved override is parsed with Hydra's own override parser (never
  split on ``=``) and refused when it could import or call code: any
  ``hydra.*`` key or ``hydra/`` group (callbacks, launchers, search paths),
  an instantiate key (``_target_`` outside this project's own targets,
  ``_partial_``, ``_args_``, ``_recursive_``, ``_convert_``), a value holding
  such a key or a resolver call (``${name:...}``; node references such as
  ``${env.id}`` are values), ``collector.post_collect_hook``, a gymnasium
  ``module:Env`` id, Ray's ``runtime_env`` or a remote ``ray.address``, a
  ``+``/``~`` item that adds an argument to (or deletes) a node the run
  instantiates, a group choice that is not one of ``conf/``'s options, or a
  ``group@package`` move. One line names every refused item and the command
  that restates them; an item the user restates on the command line is the
  user's, and accepted;
- the config stored *inside* ``checkpoint.pt`` is never used to rebuild
  anything (the runner composes from the overrides; the checkpoint only
  restores state), so it cannot smuggle a target either.

"This project's own targets" are the ``components.*``/``pipeline.*`` paths
the config tree itself names (the ``conf/`` files and the schemas Hydra's
config store holds), computed when needed, so a new config group needs no
list updated here. Hydra's target blocklist (hydra-core >= 1.3.4, pinned in
``pyproject.toml``) is a second fence behind this one, not the first: it
does not know ``torch.load``.

Paths and values are written back quoted per Hydra's override grammar
(:func:`hydra_quote`), so a run directory named by ``override_dirname``
(``runs/lr=0.1,seed=1``), or holding quotes, spaces or ``$``, resumes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.validate import ConfigError

#: Overrides a resume sets itself; saved values of these are not replayed.
_PINNED = ("resume", "hydra.run.dir")
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
#: The keys of Hydra's instantiate protocol: each decides what is called, with what, and how.
INSTANTIATE_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")
#: Keys besides ``_target_`` whose value the run imports by dotted path (pipeline/run.py: ``get_method``).
CALLABLE_KEYS = ("collector.post_collect_hook", "logger.extra_sinks")
#: ``ray.address`` values that stay on this machine (anything else joins a cluster that sends back pickles).
_LOCAL_RAY = ("local", "auto")
#: ``${a.b}``, ``${..x}``, ``${a[0]}``: a reference to another value; anything else in ``${}`` calls a resolver.
_NODE_REFERENCE = re.compile(r"\$\{[A-Za-z0-9_.\[\]-]*\}")
#: An overrides file larger than this is not one a run wrote.
_MAX_OVERRIDES_BYTES = 1 << 20


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def hydra_quote(text: str) -> str:
    """``text`` as a single-quoted value of Hydra's override grammar that composes back to ``text``.

    Inside quotes Hydra only unescapes backslashes before a quote; OmegaConf
    then still resolves ``${...}``, so every ``${`` is escaped as ``\\${``
    (and backslashes before it doubled): a path is a value, never an
    interpolation.

    Examples:
        >>> hydra_quote("runs/lr=0.1,seed=1")
        "'runs/lr=0.1,seed=1'"
        >>> hydra_quote("it's ${HOME}")
        "'it\\\\'s \\\\${HOME}'"
    """
    from hydra.core.override_parser.types import Quote, QuotedString

    escaped = re.sub(r"(\\*)\$\{", lambda m: "\\" * (2 * len(m.group(1)) + 1) + "${", text)
    return QuotedString(escaped, Quote.single).with_quotes()


def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _parse(item: str) -> Any:
    """One override parsed by Hydra's grammar (None when it does not parse)."""
    from hydra.errors import HydraException

    try:
        return _parser().parse_override(item)
    except (HydraException, ValueError, TypeError, AttributeError):
        return None


def _override_key(override: Any) -> str:
    return override.key_or_group + (f"@{override.package}" if override.package is not None else "")


def _arg_key(item: str) -> str:
    """The key an argument sets, as Hydra reads it (``+a.b=1`` and ``a.b=2`` set the same key)."""
    override = _parse(item)
    return _override_key(override) if override is not None else _key(item)


@dataclass(frozen=True)
class ProjectConfigs:
    """What the project's own config tree names: its targets, the nodes it instantiates, its groups."""

    #: dotted paths under ``components.``/``pipeline.`` that some config of the project uses as ``_target_``
    targets: frozenset[str]
    #: config paths of the nodes that hold a ``_target_`` (what the run instantiates: env.factory, model, ...)
    call_nodes: frozenset[str]
    #: config group -> the options it offers
    groups: dict[str, frozenset[str]]


def _walk_targets(node: Any, prefix: str, targets: set[str], nodes: set[str]) -> None:
    if isinstance(node, dict):
        target = node.get("_target_")
        if isinstance(target, str) and target.startswith(("components.", "pipeline.")):
            targets.add(target)
            nodes.add(prefix)
        for key, value in node.items():
            if isinstance(key, str) and key != "defaults":
                _walk_targets(value, f"{prefix}.{key}" if prefix else key, targets, nodes)
    elif isinstance(node, list):
        for value in node:
            _walk_targets(value, prefix, targets, nodes)


def _package(text: str, group: str) -> str:
    """The package a config file's contents go to: its ``# @package`` header, else its group."""
    for line in text.splitlines()[:20]:
        match = re.match(r"\s*#\s*@package\s+(\S+)", line)
        if match:
            return "" if match.group(1) == "_global_" else match.group(1).replace("_group_", group)
    return group.replace("/", ".")


@lru_cache(maxsize=1)
def project_configs() -> ProjectConfigs:
    """Read the ``conf/`` tree and the schemas in Hydra's config store (cached: the tree does not change)."""
    import yaml
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from pipeline.schema import register

    targets: set[str] = set()
    nodes: set[str] = set()
    groups: dict[str, set[str]] = {}
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        group = path.parent.relative_to(CONF_DIR).as_posix()
        group = "" if group == "." else group
        if group:
            groups.setdefault(group, set()).add(path.stem)
        text = path.read_text(encoding="utf-8")
        try:
            content = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        package = _package(text, group)
        _walk_targets(content, package, targets, nodes)
    register()
    store = ConfigStore.instance()

    def walk(group: str) -> None:
        for name in store.list(group):
            path = f"{group}/{name}" if group else name
            if not name.endswith(".yaml"):
                if path != "hydra":  # Hydra's own configs: hydra.* is refused whole
                    walk(path)
                continue
            if group:
                groups.setdefault(group, set()).add(name.removesuffix(".yaml"))
            stored = store.load(path)
            content = OmegaConf.to_container(stored.node, resolve=False, throw_on_missing=False) \
                if OmegaConf.is_config(stored.node) else stored.node
            _walk_targets(content, (stored.package or group).replace("/", "."), targets, nodes)

    walk("")
    return ProjectConfigs(frozenset(targets), frozenset(nodes), {g: frozenset(o) for g, o in groups.items()})


def _leaves(value: Any) -> tuple[list[str], list[str]]:
    """The string leaves of a parsed value and the dict keys in it, at any depth."""
    strings: list[str] = []
    keys: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            keys.extend(str(k) for k in item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            strings.append(item)
    return strings, keys


def _within(key: str, node: str) -> bool:
    return key == node or key.startswith(node + ".")


def refusal(override: Any, project: ProjectConfigs) -> str | None:
    """Why a saved override could import or call code (None: it only sets values).

    Examples:
        >>> from pipeline.resume import project_configs
        >>> refusal(_parse("trainer.lr=0.001"), project_configs()) is None
        True
        >>> refusal(_parse("env.factory._target_=torch.load"), project_configs())
        "a _target_ that none of this project's configs uses"
    """
    key = override.key_or_group
    last = key.rsplit(".", 1)[-1]
    if override.is_hydra_override() or key == "hydra":
        return "a hydra.* setting: callbacks, launchers and search paths load code"
    if override.package is not None:
        return "moves a config group to another package"
    value = None if override.is_delete() else override.value()
    if key in project.groups:
        if override.is_delete() or value is None:
            return None
        if not isinstance(value, str) or value not in project.groups[key]:
            return f"selects a config that is not one of {key}'s options in conf/"
        return None
    if last in INSTANTIATE_KEYS:
        if last == "_target_" and not override.is_delete() and isinstance(value, str) and value in project.targets:
            return None
        return f"a {last} that none of this project's configs uses" if last == "_target_" \
            else f"a {last} (decides what instantiate calls and how)"
    if override.is_delete() and any(_within(node, key) for node in project.call_nodes):
        return "deletes a node the run instantiates"
    if (override.is_add() or override.is_force_add()) and any(_within(key, node) for node in project.call_nodes):
        owner = max((node for node in project.call_nodes if _within(key, node)), key=len)
        return f"adds an argument to what {owner} calls"
    if key in CALLABLE_KEYS:
        named = value if isinstance(value, list) else [] if value is None else [value]
        if any(not (isinstance(v, str) and v in project.targets) for v in named):
            return "names a callable the run imports"
    if last == "id" and isinstance(value, str) and ":" in value:
        return "a gymnasium id with a module: part imports that module"
    if key == "ray.runtime_env" and value:
        return "a Ray runtime_env installs packages and runs setup hooks"
    if key == "ray.address" and value is not None and str(value) not in _LOCAL_RAY:
        return "joins a Ray cluster it names (which sends back pickles)"
    strings, keys = _leaves(value)
    inner = [k for k in keys if k in INSTANTIATE_KEYS]
    if inner:
        return f"its value holds a {inner[0]} (instantiate would call it)"
    if any("${" in _NODE_REFERENCE.sub("", s) for s in strings):
        return "its value calls an interpolation resolver (${name:...})"
    return None


def _show(item: str) -> str:
    """``item`` as the user would type it in a shell (control characters escaped: one line)."""
    return shlex.quote(item) if item.isprintable() else repr(item)


def read_saved_overrides(path: Path, where: str) -> list[str]:
    """The list of strings in ``.hydra/overrides.yaml``; anything else is one :class:`ConfigError` line.

    Read with ``yaml.safe_load``, not OmegaConf: iterating an OmegaConf
    list resolves interpolations, which would call resolvers from the file.
    """
    import yaml

    name = ".hydra/overrides.yaml"
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no run to resume there (no {name})") from None
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {name} ({err.strerror or err})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{where}: {name} is not a regular file")
    if info.st_size > _MAX_OVERRIDES_BYTES:
        raise ConfigError(f"{where}: {name} holds {info.st_size} bytes; a run writes a short list")
    try:
        with open(path, "rb") as fh:
            text = fh.read(_MAX_OVERRIDES_BYTES + 1).decode("utf-8")
        saved = yaml.safe_load(text)
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {name} ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {name} is not UTF-8 text") from None
    except yaml.YAMLError as err:
        first = " ".join(str(err).split())
        raise ConfigError(f"{where}: {name} is not valid YAML ({first[:200]})") from None
    if saved is None:
        return []
    if not isinstance(saved, list) or not all(isinstance(item, str) for item in saved):
        raise ConfigError(f"{where}: {name} is not a YAML list of override strings")
    return saved


def _resume_value(item: str) -> str:
    """The path ``resume=...`` names: the text as typed when that path exists, else the value as Hydra reads it.

    ``resume=runs/lr=0.1,seed=1`` (Hydra would read a sweep, or fail) is a
    directory as typed; ``resume="'runs/a b'"`` is unquoted as Hydra would.
    """
    raw = item.split("=", 1)[1]
    if raw and os.path.isdir(os.path.expanduser(raw)):
        return raw
    override = _parse(item.lstrip("+~"))
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
    from pipeline.state import CheckpointError, read_run_state

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
        override = _parse(item)
        if override is None:
            raise ConfigError(f"{where}: .hydra/overrides.yaml holds {item!r}, which is not an override "
                              "Hydra's grammar parses")
        key = _override_key(override)
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
