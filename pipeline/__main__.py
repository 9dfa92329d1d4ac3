"""``python -m pipeline [overrides]``: compose the config, run one job (or a sweep with -m).

Kept import-light on purpose: spawned worker processes re-import the main
module, and they must not pay for Hydra or torch.
"""

from __future__ import annotations

from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def main() -> None:
    import hydra

    from pipeline.schema import register

    register()

    @hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
    def _task(cfg) -> None:  # type: ignore[no-untyped-def]
        from pipeline.run import main_from_hydra

        main_from_hydra(cfg)

    _task()


if __name__ == "__main__":
    main()
