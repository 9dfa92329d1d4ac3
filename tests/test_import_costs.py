"""What a fresh process imports for its job: seconds of it where a child starts, restarts, or a test spawns many.

tensordict loads ``torch._dynamo`` (about 2 s of a fresh process on the CI machine, 5 s on a busy one).
Only the driver's collector and learner need it; an inference server process, a worker, the planner (a
config error, the bench's bare loops) or a process that only claims a run directory must not pay for it, nor
(where it needs no torch) for torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _imported(modules: list[str], heavy: list[str]) -> list[str]:
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            f"print(','.join(h for h in {heavy!r} if h in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [m for m in done.stdout.strip().split(",") if m]


@pytest.mark.parametrize(("modules", "heavy"), [
    # the inference server process: its loop, transport, engines and the models it serves (torch, no tensordict)
    (["components.inference.server", "components.inference.serving", "components.models", "components.recurrent"],
     ["tensordict", "torch._dynamo"]),
    # a process worker (numpy engine: no torch at all; test_collector.py checks a running one's maps)
    (["components.collector.worker", "components.inference.inline", "components.inference.numpy_engine"],
     ["tensordict", "torch._dynamo", "torch"]),
    # a run-directory claim (the runner's lock, a sweep's glue) and the package names of the plan, unused
    (["pipeline.runner.run_lock", "pipeline.plan.validate", "pipeline.plan"], ["tensordict", "torch._dynamo", "torch"]),
    # the planner (a config error is one line before any collector exists; the bench's bare loops build their envs
    # with it): torch for the probes' models, not tensordict
    (["pipeline.plan.inputs", "pipeline.plan.resolve", "pipeline.plan.validate"], ["tensordict", "torch._dynamo"]),
    # the config schema every composition checks against: a mistyped key is one line before torch loads
    (["pipeline.plan.schema", "components.trainers.settings"], ["tensordict", "torch._dynamo", "torch"]),
    # the metric-sink host and the video recorder (their own processes): neither serves a model
    (["components.sinks.host", "pipeline.runner.video_recorder"], ["tensordict", "torch._dynamo", "torch"]),
], ids=["server", "worker", "run-lock", "plan", "schema", "sinks-and-video"])
def test_a_child_imports_no_more_than_its_job_needs(modules, heavy):
    assert _imported(modules, heavy) == []
