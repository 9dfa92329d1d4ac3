"""What a failed part of a collector graph was, and how many times it may be replaced.

A failure carries a kind, decided where it happened (the worker that could
not build its envs, the env block that saw a NaN, the Ray host whose
``__init__`` raised), so whoever decides on a restart reads the kind and
never searches the message for words. The message stays the one line a user
reads. Local workers and Ray hosts share one :class:`RestartBudget`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass


class FailureKind(enum.IntEnum):
    """Why a part failed, as far as a restart is concerned (an ``int8`` in shared memory)."""

    #: an exception in a step or reset, a kill, a segfault, a hang: fresh envs may well run
    CRASH = 0
    #: the envs could not be built (or a Ray host could not start): the same again fails the same way
    BUILD = 1
    #: an env returned a NaN or infinite reward or observation: a bug to see, not to retry
    NON_FINITE = 2

    @property
    def retryable(self) -> bool:
        return self is FailureKind.CRASH


@dataclass(frozen=True)
class Failure:
    """One failed part: the user's line and its kind."""

    message: str
    kind: FailureKind = FailureKind.CRASH


class CollectorError(RuntimeError):
    """A worker, a host or the server failed, or collection stalled; the message names which and why.

    ``kind`` travels with it (through pickling, e.g. out of a Ray host), so a
    driver that holds graphs of its own decides on restarts by it.
    """

    def __init__(self, message: str, kind: FailureKind = FailureKind.CRASH) -> None:
        super().__init__(message)
        self.kind = FailureKind(kind)

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return type(self), (str(self), int(self.kind))


class NonFiniteStep(ValueError):
    """An env returned a NaN or infinite reward or observation (and ``trainer.nan_policy`` is ``fail``)."""


class RestartBudget:
    """At most ``max_restarts`` replacements of each part (by key) within ``window`` seconds.

    ``setting`` names the option a user raises when the budget runs out.
    """

    def __init__(self, max_restarts: int, window: float, setting: str = "workers.max_restarts") -> None:
        self.max_restarts, self.window, self.setting = int(max_restarts), float(window), setting
        self.count = 0
        self._times: dict[Hashable, list[float]] = {}

    def admit(self, key: Hashable, failure: Failure) -> int:
        """Count a restart of ``key`` and return its number within the window, or raise :class:`CollectorError`.

        It raises with the failure's own line when nothing may be restarted
        or the kind is not retryable, and with the budget spelled out when
        ``key`` used it up.
        """
        if self.max_restarts <= 0 or not failure.kind.retryable:
            raise CollectorError(failure.message, failure.kind)
        now = time.monotonic()
        recent = [t for t in self._times.get(key, []) if now - t < self.window]
        if len(recent) >= self.max_restarts:
            raise CollectorError(f"{failure.message} (after {len(recent)} restart(s) within {self.window:g} s; "
                                 f"{self.setting}={self.max_restarts})", failure.kind)
        self._times[key] = [*recent, now]
        self.count += 1
        return len(recent) + 1
