"""The benchmark's settings checked before anything runs: one line and exit 2, not a failed trial minutes in.

The benchmark's config tree has no schema (its workloads are plain
overrides), so what Hydra lets through is checked here: the counts and
durations, and every contender name (:func:`~pipeline.bench.contenders.check_contender`).
"""

from __future__ import annotations

from typing import Any

from pipeline.bench.contenders import check_contender


class BenchConfigError(ValueError):
    """A setting no trial can run with (a contender name, a count, a duration): one line and exit 2 before any trial."""


#: numeric settings: (key, type, smallest allowed value)
_NUMBERS = (("num_envs", int, 1), ("repeats", int, 1), ("seconds", float, 1e-9), ("warmup", float, 0.0),
            ("trial_timeout", float, 1e-9), ("torchrl_max_envs", int, 0))


def _number(key: str, value: Any, kind: type, least: float) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if not ok or value < least:
        what = "an integer" if kind is int else "a number"
        bound = f">= {least:g}" if least > 1e-6 or least == 0 else "> 0"
        raise BenchConfigError(f"{key}={value!r}: must be {what} {bound}")


def check_settings(cfg: dict[str, Any]) -> None:
    """A :class:`BenchConfigError` for the first setting no trial can run with (checked before the cost probe)."""
    for key, kind, least in _NUMBERS:
        if key in cfg:
            _number(key, cfg[key], kind, least)
    for key in ("sweep_envs",):
        values = cfg.get(key) or []
        if not isinstance(values, list):
            raise BenchConfigError(f"{key}={values!r}: must be a list of env counts, e.g. [8,16,32]")
        for value in values:
            _number(key, value, int, 1)
    if not isinstance(cfg.get("scale", False), bool):
        raise BenchConfigError(f"scale={cfg['scale']!r}: must be true or false")
    chosen = cfg.get("contenders", "default")
    if isinstance(chosen, str) and chosen not in ("all", "default"):
        raise BenchConfigError(f"contenders={chosen!r}: 'all', 'default' or a list of names")
    for name in ([] if isinstance(chosen, str) else list(chosen)) + list(cfg.get("sweep_contenders") or []):
        try:
            check_contender(str(name))
        except ValueError as err:
            raise BenchConfigError(str(err)) from None
