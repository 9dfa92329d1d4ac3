#!/usr/bin/env bash
# Set up .venv with rlpipeline and everything it needs; safe to run again
# (it only reinstalls when pyproject.toml changed).
#
# torch is installed first and pinned: a bare torch requirement on a machine
# without torch pulls a multi-GB CUDA build, while torch==2.13.0 is the CPU
# build. Set TORCH_SPEC (e.g. TORCH_SPEC="torch>=2.4") on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.rlpipeline-installed
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[atari,dev,sweep,box2d,mujoco,ray,video]" "$TORCH_SPEC"
    # hydra/launcher=ray (sweeps as Ray tasks). --no-deps: its cloudpickle<3 pin is for its AWS launcher
    # only and would break joblib (hydra/launcher=joblib needs cloudpickle>=3); its real needs come with ray.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "hydra-ray-launcher==1.2.2"
    touch "$stamp"
fi
