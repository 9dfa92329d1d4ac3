"""``python -m pipeline [overrides]``: compose the config, run one job (or a sweep with -m).

Kept import-light on purpose: spawned worker processes re-import the main
module, and they must not pay for Hydra or torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def main() -> None:
    try:
        _main()
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM before the runner took over its signals
        print(f"interrupted during start-up ({err or 'SIGINT'}); nothing was written", file=sys.stderr, flush=True)
        from pipeline.signals import exit_interrupted

        exit_interrupted(130)
    except SystemExit as exit_:
        if exit_.code is not None and not isinstance(exit_.code, int):
            raise  # a message for the interpreter to print
        _leave(exit_.code or 0)
    _leave(0)


def _leave(code: int) -> None:
    from pipeline.signals import leave

    leave(code)


def _main() -> None:
    from pipeline.signals import catch_early

    catch_early()  # SIGTERM during start-up ends like Ctrl-C: one line, 130

    from pipeline.resume import resume_argv
    from pipeline.validate import ConfigError

    try:
        sys.argv[1:] = resume_argv(sys.argv[1:])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)

    import hydra

    from pipeline.schema import register

    register()

    @hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
    def _task(cfg):  # type: ignore[no-untyped-def]  # noqa: ANN202 - the sweep objective, or None
        from pipeline.run import main_from_hydra

        return main_from_hydra(cfg)

    _task()


if __name__ == "__main__":
    main()
