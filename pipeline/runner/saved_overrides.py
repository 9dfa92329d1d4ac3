"""Vetting the overrides saved in a run directory, before a resume replays them.

Why this module exists: a run directory is untrusted input. It is data
someone may have sent, downloaded or left in a shared place, so its
``.hydra/overrides.yaml`` may set values, never run code. This module
decides which saved items may be replayed (:func:`refusal`), against what
the project's own config tree names (:func:`project_configs`), reads the
file without resolving anything (:func:`read_saved_overrides`) and writes
paths back in Hydra's grammar (:func:`hydra_quote`); :mod:`pipeline.runner.resume`
builds the resumed command line from them.

Each saved override is parsed with Hydra's own override parser (never
split on ``=``) and refused when it could import or call code: any
``hydra.*`` key or ``hydra/`` group (callbacks, launchers, search paths),
an instantiate key (``_target_`` outside this project's own targets,
``_partial_``, ``_args_``, ``_recursive_``, ``_convert_``), a value holding
such a key or a resolver call (``${name:...}``; node references such as
``${env.id}`` are values), ``collector.post_collect_hook``, ``logger.extra_sinks``, a gymnasium
``module:Env`` id, Ray's ``runtime_env`` or a remote ``ray.address``, a
``+``/``~`` item that adds an argument to (or deletes) a node the run
instantiates, a group choice that is not one of ``conf/``'s options, or a
``group@package`` move.

"This project's own targets" are the ``components.*``/``pipeline.*`` paths
the config tree itself names (the ``conf/`` files and the schemas Hydra's
config store holds), computed when needed, so a new config group needs no
list updated here. Hydra's target blocklist (hydra-core >= 1.3.8, pinned in
``pyproject.toml``) is a second fence behind this one, not the first: it
does not know ``torch.load``.

Paths and values are written back quoted per Hydra's override grammar
(:func:`hydra_quote`), so a run directory named by ``override_dirname``
(``runs/lr=0.1,seed=1``), or holding quotes, spaces or ``$``, resumes.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline import CONF_DIR
from pipeline.plan.validate import ConfigError

#: The keys of Hydra's instantiate protocol: each decides what is called, with what, and how.
INSTANTIATE_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")
#: Keys besides ``_target_`` whose value the run imports by dotted path (pipeline/runner/run.py: ``get_method``).
CALLABLE_KEYS = ("collector.post_collect_hook", "logger.extra_sinks")
#: ``ray.address`` values that stay on this machine (anything else joins a cluster that sends back pickles).
_LOCAL_RAY = ("local", "auto")
#: ``${a.b}``, ``${..x}``, ``${a[0]}``: a reference to another value; anything else in ``${}`` calls a resolver.
_NODE_REFERENCE = re.compile(r"\$\{[A-Za-z0-9_.\[\]-]*\}")
#: An overrides file larger than this is not one a run wrote.
_MAX_OVERRIDES_BYTES = 1 << 20


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


def parse(item: str) -> Any:
    """One override parsed by Hydra's grammar (None when it does not parse)."""
    from hydra.errors import HydraException

    try:
        return _parser().parse_override(item)
    except (HydraException, ValueError, TypeError, AttributeError):
        return None


def override_key(override: Any) -> str:
    return override.key_or_group + (f"@{override.package}" if override.package is not None else "")


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

    from pipeline.plan.schema import register

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
            content = OmegaConf.to_container(stored.node, resolve=False, throw_on_missing=False, enum_to_str=True) \
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
        >>> from pipeline.runner.saved_overrides import project_configs
        >>> refusal(parse("trainer.lr=0.001"), project_configs()) is None
        True
        >>> refusal(parse("env.factory._target_=torch.load"), project_configs())
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
