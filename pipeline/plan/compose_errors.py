"""One line for an error Hydra raised while composing a config (the runner's and the benchmark's).

Hydra reports a bad override (a wrong type, an unknown key or option, a
syntax error) in several lines with exit 1; ``python -m pipeline`` and
``python -m pipeline.bench`` say it in one ``config error:`` line and exit 2,
as every other bad value.
"""

from __future__ import annotations


def composition_error(err: BaseException) -> str | None:
    """One line for an error Hydra raised while composing the config; None for anything else."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    if not isinstance(err, HydraException):
        return None
    if isinstance(err, OverrideParseException):  # its message does not name the override
        first = str(err).strip().splitlines()[0] if str(err).strip() else "a syntax error"
        return f"cannot parse the override {err.override!r}: {first} (see Hydra's override grammar)"
    if isinstance(err, MissingConfigException) and err.options:
        first = str(err).strip().splitlines()[0]
        return f"{first} (available: {', '.join(sorted(err.options))})"
    word = _not_a_word(err.__cause__)
    if word is not None:
        return word
    lines = [line.strip().rstrip(".") for line in str(err).splitlines() if line.strip()]
    parts = ["; ".join(lines) or type(err).__name__]
    if err.__cause__ is not None and str(err.__cause__).strip():
        parts.append(str(err.__cause__).strip().splitlines()[0])
    return ": ".join(parts)


def _not_a_word(cause: BaseException | None) -> str | None:
    """A word no allowed-words field takes (components/kinds.py), said as every other bad value is."""
    import re

    key = getattr(cause, "full_key", None)
    found = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", str(cause or "").strip())
    if not key or found is None:
        return None
    return f"{key}={found.group(1)!r}: must be one of {found.group(2)}"
