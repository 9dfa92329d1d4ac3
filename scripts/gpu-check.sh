#!/usr/bin/env bash
# The GPU check: everything the CUDA paths need verified, in one run on a CUDA machine.
#
#   bash scripts/gpu-check.sh            # from a fresh clone on a machine with an NVIDIA GPU
#
# 1. sets up .venv (scripts/setup.sh with a CUDA torch: TORCH_SPEC defaults to
#    torch>=2.4 here, the PyPI Linux wheels carry CUDA) unless PYTHON_BIN names an
#    interpreter that already has torch with CUDA and this project's dependencies;
# 2. runs the CUDA tests (pytest -m cuda: pinned staging, CUDA graphs, CUDA-IPC
#    weights, CUDA replay);
# 3. runs the Pong benchmark with the policy on the GPU: the central server in a
#    process, CUDA graph off and on, and a worker-count sweep up to the machine's
#    cores (1, 2, 4, ... worker processes of 16 envs / workers each);
# 4. prints one table (and writes runs/gpu-check/<time>/gpu-check.md).
#
# Exit status: 2 without a usable GPU, 1 when the tests fail, 0 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
out="runs/gpu-check/$(date +%Y-%m-%d_%H-%M-%S)"
mkdir -p "$out"

if [ -n "${PYTHON_BIN:-}" ]; then
    py="$PYTHON_BIN"
else
    TORCH_SPEC=${TORCH_SPEC:-"torch>=2.4"} bash scripts/setup.sh
    py=.venv/bin/python
fi
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "error: no CUDA device is visible to torch ($("$py" -c 'import torch; print(torch.__version__)')); nothing to check" >&2
    exit 2
fi
gpu=$("$py" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB")')
cores=$(nproc)
echo "gpu-check: $gpu, $cores CPU cores, torch $("$py" -c 'import torch; print(torch.__version__, torch.version.cuda)')"

status=0
set +e
"$py" -m pytest -m cuda -q -p no:cacheprovider 2>&1 | tee "$out/cuda-tests.log"
tests=${PIPESTATUS[0]}
set -e
[ "$tests" -eq 0 ] || status=1

# Worker counts 1, 2, 4, ... up to the cores (16 Pong envs: at most 16 workers).
contenders='"ours:auto","ours:process/slots/process/auto","ours:process/slots/process/auto@graph=16"'
workers=1
while [ "$workers" -le "$cores" ] && [ "$workers" -le 16 ]; do
    epw=$(( (16 + workers - 1) / workers ))
    contenders="$contenders,\"ours:process/slots/process/auto@epw=$epw,splits=1\""
    workers=$(( workers * 2 ))
done
contenders="$contenders,\"gym_async\""
set +e
"$py" -m pipeline.bench bench_workload=pong device=cuda repeats=2 seconds=4 \
    "contenders=[$contenders]" "hydra.run.dir=$out/bench" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
set -e
[ "$bench" -eq 0 ] || status=1

{
    echo "## GPU check: $gpu, $cores CPU cores"
    echo
    echo "CUDA tests (pytest -m cuda): $(grep -E '(passed|failed|error)' "$out/cuda-tests.log" | tail -1)"
    echo
    echo "Pong + Nature CNN, 16 envs, policy on the GPU (python -m pipeline.bench bench_workload=pong device=cuda):"
    echo
    sed -n '/^| contender/,/^$/p' "$out/bench.log"
    grep -E '^machine limit' "$out/bench.log" || true
} | tee "$out/gpu-check.md"
echo "gpu-check: written to $out/gpu-check.md (exit $status)"
exit "$status"
