"""``python -m pipeline.bench [overrides]``: run the collector benchmark (Hydra-configured).

Examples::

    python -m pipeline.bench                                   # CartPole + MLP, 64 envs
    python -m pipeline.bench bench_workload=pong               # Pong + Nature CNN, 16 envs
    python -m pipeline.bench 'sweep_envs=[8,16,32,64,128,256]' # best of each contender over env counts
    python -m pipeline.bench 'contenders=[gym_sync,ours:process/slots/process/auto]' repeats=5
"""

from __future__ import annotations

import sys
from pathlib import Path

#: the benchmark's own config tree: its workloads are not choices of the runner
BENCH_CONF_DIR = Path(__file__).resolve().parent / "conf"


def main() -> None:
    import os

    import hydra

    from pipeline.plan.compose_errors import composition_error

    @hydra.main(config_path=str(BENCH_CONF_DIR), config_name="bench", version_base="1.3")
    def _task(cfg) -> None:  # type: ignore[no-untyped-def]
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        from pipeline.bench.harness import run_bench
        from pipeline.bench.settings import BenchConfigError

        plain = OmegaConf.to_container(cfg, resolve=True)
        plain["workload"] = plain.pop("bench_workload")
        try:
            run_bench(plain, Path(HydraConfig.get().runtime.output_dir))
        except BenchConfigError as err:  # before any trial: one line, as a config error of the runner
            print(f"config error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)

    # As the runner does: Hydra raises instead of printing its report, and a composing error (an override it
    # cannot parse, an unknown key or workload) is one line and exit 2; a user who set HYDRA_FULL_ERROR keeps Hydra's.
    hydra_report = "HYDRA_FULL_ERROR" in os.environ
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        _task()
    except Exception as err:  # noqa: BLE001 - only composing errors are turned into one line
        line = None if hydra_report else composition_error(err)
        if line is None:
            raise
        if "@" in line and "cannot parse" in line:  # ours:<layout>@opt=value unquoted in a Hydra list
            line += "; quote a contender with options: \"contenders=['ours:process/none/inline/auto@epw=8']\""
        print(f"config error: {line}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
