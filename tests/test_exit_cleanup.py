"""A script that ends without shutting its collector down exits, and leaves no process behind.

Worker and server processes ignore SIGTERM (Ctrl-C belongs to the driver),
and multiprocessing's exit hook SIGTERMs daemonic children and then joins
them with no timeout: without the collector's at-exit shutdown (and the
kill backstop under it) such a script would hang at its last line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import sys
from components.collector.collector import AsyncBatchedCollector
from components.collector.graph import GraphSpec
from components.envs import GymEnvFactory
from components.models import ModelSpec

def main():
    collector = AsyncBatchedCollector(
        GymEnvFactory("CartPole-v1"), ModelSpec("components.models.ActorCritic"),
        GraphSpec(workers="process", server=sys.argv[1], num_envs=4, envs_per_worker=2, chunk_len=8),
        frames_per_batch=64, stall_timeout=30.0)
    collector.start()
    print("pids", *collector.workers.pids, flush=True)
    next(iter(collector))
    if sys.argv[2] == "raise":
        raise RuntimeError("the user's script failed after its first batch")

if __name__ == "__main__":
    main()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("server,ending", [("inline", "raise"), ("process", "return")])
def test_a_script_that_never_shuts_its_collector_down_still_exits(tmp_path, server, ending):
    script = tmp_path / "user_script.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(script), server, ending], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the script hung at exit ({time.monotonic() - started:.0f} s): {exc.stdout!r}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("pids ")]
    assert lines, done.stdout + done.stderr
    pids = [int(p) for p in lines[0].split()[1:]]
    assert len(pids) == 2
    if ending == "raise":
        assert done.returncode == 1 and "the user's script failed" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a worker process outlived its script"
    assert "leaked" not in done.stderr  # shut down in order: the shared memory was released, not swept up
