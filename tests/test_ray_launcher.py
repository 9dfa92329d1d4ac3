"""hydra/launcher=ray: sweep jobs as Ray tasks, each job's workers=ray run joining the launcher's cluster.

A module of its own: the launcher's ``ray.init()`` joins any cluster already
running on this machine, so it must not share a module with test_ray's.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.conftest import run_pipeline
from tests.test_ray import _ray_pids, _rows

# Never beside the other Ray module (the suite runs two files at a time): both count the machine's raylets and
# hosts, and the launcher's ray.init() would join this module's cluster.
pytestmark = pytest.mark.usefixtures("ray_machine_lock")

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")


@pytest.mark.timeout(900)  # may first wait for test_ray.py's module to end (ray_machine_lock)
def test_a_sweep_launched_on_ray_runs_each_job_on_the_launchers_cluster(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="hydra-ray-launcher is not installed")
    before = _ray_pids("raylet") | _ray_pids("gcs_server")
    sweep_dir = tmp_path / "sweep"
    done = run_pipeline(["-m", "hydra/launcher=ray", "workers=ray", "ray.num_actors=1", "seed=0,1",
                         "trainer.total_frames=2048", "progress=false", "logger=jsonl", f"hydra.sweep.dir={sweep_dir}",
                         # jobs take no CPU of their own (their env hosts do); Ray's default object store, not 75 MB
                         "+hydra.launcher.ray.remote.num_cpus=0", "+hydra.launcher.ray.init.num_cpus=2",
                         "+hydra.launcher.ray.init.object_store_memory=200000000",
                         "+hydra.launcher.ray.init.include_dashboard=false"],
                        cwd=tmp_path, timeout=240, env={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("the Ray job this run is part of") == 2, done.stdout[-3000:]
    records = [json.loads(line) for line in (sweep_dir / "sweep.jsonl").read_text().splitlines()]
    assert sorted(r["status"] for r in records) == ["finished", "finished"], records
    for job in ("0", "1"):
        assert _rows(sweep_dir / job)[-1]["summary"]["frames"] == 2048
    deadline = time.monotonic() + 15
    while (_ray_pids("raylet") | _ray_pids("gcs_server")) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not (_ray_pids("raylet") | _ray_pids("gcs_server")) - before
