"""What a Ray failure says in one line: the cause a user can act on, not Ray's wrapper.

A host whose ``__init__`` raised (an env that cannot be built, a bug in
its code) dies like a killed one, as a ``RayActorError``; only the flag
``actor_init_failed`` and the text of the creation task's traceback tell
them apart. A run that failed because its envs could not be built must
say so, not "process killed or node lost".
"""

from __future__ import annotations

from typing import Any

from components.collector.failures import CollectorError, Failure, FailureKind


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def ray_failure(err: BaseException, exceptions: Any) -> Failure:
    """One line for ``err`` raised by a Ray call (``exceptions``: ``ray.exceptions``), and its kind.

    A host's own collector error (an env crash, a hang, a NaN) keeps its
    line and kind; a host that could not start is ``BUILD`` (starting it
    again would fail the same way); a dead actor and anything else is a
    ``CRASH``.
    """
    if isinstance(err, exceptions.RayTaskError):
        cause = err.cause if getattr(err, "cause", None) is not None else err
        text = str(cause).strip().splitlines()
        if isinstance(cause, CollectorError):
            return Failure(text[0] if text else type(cause).__name__, cause.kind)
        return Failure(f"{type(cause).__name__}: {text[-1]}" if text else type(cause).__name__)
    if isinstance(err, exceptions.RayActorError):
        if getattr(err, "actor_init_failed", False):
            return Failure(f"its env host failed to start: {_last_line(str(err)) or type(err).__name__}",
                           FailureKind.BUILD)
        return Failure("its actor died (process killed or node lost)")
    text = str(err).strip().splitlines()
    return Failure(f"{type(err).__name__}: {text[0] if text else ''}")
