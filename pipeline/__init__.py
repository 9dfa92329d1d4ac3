"""The runner: config -> resolved plan -> running collector graph -> trainer loop."""

from pathlib import Path

#: the Hydra config tree every entry point composes from (the runner, the benchmark, resume, presets)
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
