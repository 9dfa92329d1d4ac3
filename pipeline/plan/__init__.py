"""The plan: what graph, devices and chunking a config means on this machine.

:mod:`pipeline.plan.rules` owns every ``auto`` rule, :mod:`pipeline.plan.resolve`
turns a validated config into a :class:`Plan` with them (each line a
:class:`Choice`: value, rule code, facts), :mod:`pipeline.plan.render` writes
the sentences the plan prints from those choices, and
:mod:`pipeline.plan.inputs` probes what the plan depends on (the env's spec,
the layout costs). The runner and the benchmark both plan through
:func:`plan_config`, so they build the same graphs.
"""

from pipeline.plan.choice import Choice
from pipeline.plan.resolve import WAITING_RATIO, Machine, Plan, resolve_plan, serving_engine
from pipeline.plan.rules import AUTO_MIN_TRANSITIONS, NUMPY_MODELS

__all__ = ["AUTO_MIN_TRANSITIONS", "NUMPY_MODELS", "WAITING_RATIO", "Choice", "Machine", "Plan", "resolve_plan",
           "serving_engine"]
