"""Interaction (exploration) modes that travel with every inference request.

A mode is a small integer stamped per observation row, so one server batch
can serve exploring training workers and greedy evaluation workers at once,
and the server never consults process-global state (a learner thread in the
same process may change that at any time).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class InteractionMode(IntEnum):
    """How the served policy turns its output distribution into an action.

    ``RANDOM`` samples (exploration); the other modes act greedily (the
    distribution's mode or mean; for the built-in heads they coincide).
    """

    RANDOM = 0
    MODE = 1
    MEAN = 2
    DETERMINISTIC = 3

    @classmethod
    def parse(cls, value: Any) -> InteractionMode:
        """Accept an ``InteractionMode``, its name, its code, or a tensordict ``InteractionType``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, int):
            return cls(value)
        name = getattr(value, "value", value)
        if isinstance(name, str):
            try:
                return cls[name.upper()]
            except KeyError:
                pass
        allowed = ", ".join(m.name.lower() for m in cls)
        raise ValueError(f"unknown interaction mode {value!r} (allowed: {allowed})")
