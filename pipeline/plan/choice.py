"""What every decision of the plan returns: the value, the rule that gave it, and the facts it was decided from.

Deciding and explaining are separate passes: the rules (:mod:`pipeline.plan.rules`)
and the resolver (:mod:`pipeline.plan.resolve`) only return :class:`Choice`
values, and :mod:`pipeline.plan.render` writes every sentence the plan prints
from their codes and facts. So a test (or a dashboard) can ask *why* a value was
chosen by its code, and a sentence changes in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Choice(Generic[T]):
    """A decided ``value``; ``code`` names the rule (or branch) that decided it; ``facts`` are its inputs.

    Codes are dotted words: ``given`` (the user's value, as is), ``auto.*``
    (the branch of an ``auto`` rule that applied), or a kind's name. Facts may
    hold other choices that this one was built from (the server's device and
    engine, the workers' envs per worker).
    """

    value: T
    code: str
    facts: Mapping[str, Any] = field(default_factory=dict)

    def fact(self, name: str, default: Any = None) -> Any:
        return self.facts.get(name, default)
