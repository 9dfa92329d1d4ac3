"""``python -m pipeline [overrides]``: compose the config, run one job (or a sweep with -m).

Kept import-light on purpose: spawned worker processes re-import the main
module, and they must not pay for Hydra or torch.
"""

from __future__ import annotations

import sys

from pipeline import CONF_DIR
from pipeline.plan.compose_errors import composition_error


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


if __name__ == "__main__":
    main()
