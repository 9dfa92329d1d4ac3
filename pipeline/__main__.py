"""``python -m pipeline [overrides]``: compose the config, run one job (or a sweep with -m).

Kept import-light on purpose: spawned worker processes re-import the main
module, and they must not pay for Hydra or torch.
"""

from __future__ import annotations

import sys

from pipeline import CONF_DIR


def main() -> None:
    try:
        _main()
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM before the runner took over its signals
        print(f"interrupted during start-up ({err or 'SIGINT'}); nothing was written", file=sys.stderr, flush=True)
        from pipeline.runner.signals import exit_interrupted

        exit_interrupted(130)
    except SystemExit as exit_:
        if exit_.code is not None and not isinstance(exit_.code, int):
            raise  # a message for the interpreter to print
        code = exit_.code or 0
    else:
        code = 0
    from pipeline.runner.signals import leave

    leave(code)


def _main() -> None:
    from pipeline.runner.signals import catch_early, survive_closed_stdout

    catch_early()  # SIGTERM during start-up ends like Ctrl-C: one line, 130
    survive_closed_stdout()  # `python -m pipeline | head` must not kill the run

    from pipeline.runner.resume import resume_argv
    from pipeline.plan.validate import ConfigError

    try:
        sys.argv[1:] = resume_argv(sys.argv[1:])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)

    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        from pipeline.runner.help import help_text

        try:
            print(help_text([a for a in sys.argv[1:] if not a.startswith("-")]))
        except Exception as err:  # noqa: BLE001 - a composing error is one line, as for a run
            line = composition_error(err)
            if line is None:
                raise
            print(f"config error: {line}", file=sys.stderr, flush=True)
            sys.exit(2)
        sys.exit(0)

    import os

    import hydra

    from pipeline.plan.schema import register

    register()
    started: list[bool] = []

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _task(cfg):  # type: ignore[no-untyped-def]  # noqa: ANN202 - the sweep objective, or None
        started.append(True)
        from pipeline.runner.run import main_from_hydra

        return main_from_hydra(cfg)

    # Hydra reports a bad override (a wrong type, an unknown key or option, a syntax error) in several
    # lines with exit 1; with HYDRA_FULL_ERROR it raises instead, and composing errors become the
    # one `config error:` line and exit 2 every other bad value gets. A user who set it keeps Hydra's.
    hydra_report = "HYDRA_FULL_ERROR" in os.environ
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        _task()
    except Exception as err:  # noqa: BLE001 - only composing errors are turned into one line
        line = None if hydra_report or started else composition_error(err)
        if line is None:
            raise
        print(f"config error: {line}", file=sys.stderr, flush=True)
        sys.exit(2)


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


if __name__ == "__main__":
    main()
