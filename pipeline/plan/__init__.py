"""The plan: what graph, devices and chunking a config means on this machine.

:mod:`pipeline.plan.rules` owns every ``auto`` rule, :mod:`pipeline.plan.resolve`
turns a validated config into a :class:`Plan` with them (each line a
:class:`Choice`: value, rule code, facts), :mod:`pipeline.plan.render` writes
the sentences the plan prints from those choices, and
:mod:`pipeline.plan.inputs` probes what the plan depends on (the env's spec,
the layout costs). The runner and the benchmark both plan through
:func:`plan_config`, so they build the same graphs.

The names below load on first use (PEP 562): :mod:`~pipeline.plan.resolve`
brings torch and tensordict (seconds of imports in a fresh process), which a
process that only needs :mod:`~pipeline.plan.validate`'s ``ConfigError``
(a run-lock claim, a sweep's glue) should not pay for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.plan.choice import Choice
    from pipeline.plan.resolve import WAITING_RATIO, Machine, Plan, resolve_plan, serving_engine
    from pipeline.plan.rules import AUTO_MIN_TRANSITIONS, NUMPY_MODELS

#: each public name -> the module that defines it
_HOMES = {"Choice": "pipeline.plan.choice", "WAITING_RATIO": "pipeline.plan.resolve", "Machine": "pipeline.plan.resolve",
          "Plan": "pipeline.plan.resolve", "resolve_plan": "pipeline.plan.resolve",
          "serving_engine": "pipeline.plan.resolve", "AUTO_MIN_TRANSITIONS": "pipeline.plan.rules",
          "NUMPY_MODELS": "pipeline.plan.rules"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pipeline.plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # looked up once
    return value
