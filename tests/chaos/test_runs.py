"""Chaos: ``python -m pipeline`` as a user runs it, with faults injected and processes killed.

Every test is bounded in time, checks the exit code and the one line a user
sees, and that no process of the run outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, assert_group_gone, run_pipeline
from tests.procs import leaked_shm, spawned_children

pytestmark = pytest.mark.slow

FAULTY = ["env.factory._target_=tests.fakes.FaultyEnvFactory", "transport=slots"]  # faults are the workers' (no probe)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith(("wandb:", "  "))]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_two_runs_started_in_the_same_second_get_two_directories(tmp_path):
    args = ["trainer.total_frames=512", "trainer.target_return=null", "logger=jsonl", "progress=false"]
    procs = [_start(args + [f"seed={s}"], tmp_path) for s in (1, 2)]
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
    runs = sorted(p.parent for p in tmp_path.glob("runs/*/*/metrics.jsonl"))
    assert len(runs) == 2, runs
    for run in runs:
        rows = _rows(run)
        assert sum("summary" in r for r in rows) == 1 and (run / "checkpoint.pt").exists()
        assert (run / ".hydra" / "config.yaml").exists()


def test_a_refused_run_leaves_the_existing_run_untouched(tmp_path):
    run_dir = tmp_path / "run"
    first = run_pipeline(["trainer.total_frames=512", "trainer.target_return=null", "logger=jsonl",
                          "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    second = run_pipeline(["seed=7", "logger=jsonl", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert second.returncode == 2
    assert _lines(second.stderr) == [_lines(second.stderr)[0]] and "already holds a run" in second.stderr
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before, "nothing of the existing run changed, .hydra/ included"


@pytest.mark.parametrize("run_dir", ["/proc/no/such/dir", "/dev/null/run"])
def test_an_unusable_run_directory_is_one_line_and_exit_2(tmp_path, run_dir):
    result = run_pipeline([f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert _lines(result.stderr) == [f"config error: hydra.run.dir='{run_dir}': cannot write there "
                                     f"({_lines(result.stderr)[0].rsplit('(', 1)[1]}"]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_nan_reward_stops_the_run_with_one_line_naming_the_env(tmp_path, workers):
    run_dir = tmp_path / "nan"
    result = run_pipeline([*FAULTY, "+env.factory.at_step=60", "+env.factory.fault=nan_reward", f"workers={workers}",
                           "logger=jsonl", "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in _lines(result.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and "returned a non-finite reward nan" in errors[0] and "env " in errors[0]


def test_a_non_finite_loss_stops_the_run_and_keeps_no_poisoned_checkpoint(tmp_path):
    run_dir = tmp_path / "diverged"
    result = run_pipeline(["trainer.lr=1e30", "trainer.anneal_lr=false", "trainer.target_return=null",
                           "logger=jsonl", "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in _lines(result.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite gradient norm" in errors[0]
    checkpoint = run_dir / "checkpoint.pt"
    if checkpoint.exists():  # only a periodic one from before the divergence may be there
        state = torch.load(checkpoint, weights_only=True)
        assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_hung_env_step_ends_the_run_within_step_timeout(tmp_path, workers):
    proc = _start([*FAULTY, "+env.factory.at_step=300", "+env.factory.fault=hang", f"workers={workers}",
                   "workers.step_timeout=3", "workers.max_restarts=0",  # restarts: tests/chaos/test_restarts.py
                   "trainer.target_return=null", "logger=jsonl", "progress=false",
                   f"hydra.run.dir={tmp_path / 'hung'}"], tmp_path)
    started = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    errors = [line for line in _lines(err) if line.startswith("error:")]
    assert len(errors) == 1 and "hung in its step" in errors[0] and "workers.step_timeout=3" in errors[0]
    assert time.monotonic() - started < 60
    assert_group_gone(proc.pid)


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (``SigCgt`` in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (int(sig) - 1) & 1)


@pytest.mark.parametrize(("sig", "after"), [(signal.SIGINT, 0.3), (signal.SIGTERM, 1.2), (signal.SIGINT, 2.5)])
def test_a_signal_during_start_up_is_one_line_and_exit_130(tmp_path, sig, after):
    run_dir = tmp_path / "early"
    proc = _start(["workers=process", "logger=jsonl", "progress=false", f"hydra.run.dir={run_dir}"], tmp_path)
    # From its first line of Python the runner catches both signals; before that (the interpreter
    # starting, slow on a loaded machine) no program can. Count from that moment.
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, sig) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(after)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    assert_group_gone(proc.pid)
    assert "Traceback" not in out + err, err[-3000:]
    if proc.returncode == 130 and not (run_dir / "metrics.jsonl").exists():
        assert len(_lines(err)) == 1 and "interrupted" in err
    else:  # the signal came after start-up: the normal clean stop
        assert proc.returncode == 130 and (run_dir / "checkpoint.pt").exists()


def test_a_run_killed_with_sigkill_resumes_to_its_budget_with_one_curve(tmp_path):
    BUDGET = 40000  # noqa: N806
    run_dir = tmp_path / "long"
    # a budget of several seconds even on a fast machine: the kill must land before the run ends on its own
    proc = _start([f"trainer.total_frames={BUDGET}", "trainer.target_return=null", "checkpoint.interval=1",
                   "logger=jsonl", "logger.interval=0.5", "progress=false", f"hydra.run.dir={run_dir}"], tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (run_dir / "checkpoint.pt").exists() and (run_dir / "metrics.jsonl").exists() \
                and len(_rows(run_dir)) >= 3:
            break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert_group_gone(proc.pid)
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert 0 < saved["frames"] < BUDGET, "killed half-way"
    result = run_pipeline([f"resume={run_dir}"], cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(run_dir)
    frames = [r["frames"] for r in rows if "summary" not in r]
    assert frames == sorted(frames), "the frame column never goes back"
    summaries = [r["summary"] for r in rows if "summary" in r]
    assert len(summaries) == 1 and summaries[0]["frames"] == BUDGET
    final = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert final["frames"] == BUDGET and final["policy_version"] > saved["policy_version"]
    assert final["episodes"]["total"] > saved["episodes"]["total"]


@pytest.mark.parametrize("when", ["during start-up", "while training"])
def test_a_sigkilled_process_group_leaves_nothing_in_dev_shm_after_the_next_run(tmp_path, when):
    before = set(os.listdir("/dev/shm"))
    proc = _start(["workers=process", "server=process", "transport=slots", f"workers.max_restarts={0 if when == 'while training' else 3}",
                   f"server.max_restarts={0 if when == 'while training' else 1}",
                   "trainer.target_return=null", "logger=jsonl",
                   "logger.interval=0.5", "progress=false", f"hydra.run.dir={tmp_path / 'killed'}"], tmp_path)
    deadline = time.monotonic() + 120
    metrics = tmp_path / "killed" / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and (when == "during start-up" or metrics.read_text().count("\n") >= 2):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert_group_gone(proc.pid)
    if when == "while training":  # without worker restarts, the names are dropped once every process opened them
        assert not leaked_shm(before)
    # whatever a kill during start-up left is swept by the next run
    result = run_pipeline(["trainer.total_frames=256", "logger=jsonl", f"hydra.run.dir={tmp_path / 'next'}"],
                          cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    left = leaked_shm(before)
    assert not left, f"left in /dev/shm: {sorted(left)}"


def _server_pid(runner: int, timeout: float = 120.0) -> int:
    """The runner's spawned child that is not multiprocessing's resource tracker (workers=thread: the server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = spawned_children(runner)
        if children:
            return children[0][1]
        time.sleep(0.05)
    raise AssertionError("no server process appeared")


@pytest.mark.parametrize("max_restarts", [1, 0])
def test_a_sigkilled_server_process_is_restarted_once_then_fails_the_run(tmp_path, max_restarts):
    run_dir = tmp_path / "server"
    proc = _start(["server=process", "transport=slots", f"server.max_restarts={max_restarts}", "trainer.total_frames=20000",
                   "trainer.target_return=null", "logger=jsonl", "logger.interval=0.5", "progress=false",
                   f"hydra.run.dir={run_dir}"], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not ((run_dir / "metrics.jsonl").exists() and len(_rows(run_dir)) >= 2) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(_server_pid(proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=180)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert_group_gone(proc.pid)
    rows = _rows(run_dir)
    if max_restarts:
        assert proc.returncode == 0, err[-3000:]
        assert "warning: inference server (process) restarted with the weights of version" in err
        assert rows[-1]["summary"]["frames"] == 20000
        assert max(r.get("collector/server_restarts", 0) for r in rows[:-1]) == 1
    else:
        assert proc.returncode == 1, err[-3000:]
        errors = [line for line in _lines(err) if line.startswith("error:")]
        assert errors == ["error: inference server (process) died: its process exited with code -9"]
        assert ended < 15, "the run ends at once (summary and checkpoint included)"
        assert rows[-1]["summary"]["stop_reason"].startswith("failed: inference server")
        assert (run_dir / "checkpoint.pt").exists()


def test_nan_policy_skip_counts_the_bad_steps_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "skip"
    result = run_pipeline([*FAULTY, "+env.factory.at_step=60", "+env.factory.fault=nan_obs",
                           f"+env.factory.once={tmp_path / 'marker'}", "trainer.nan_policy=skip",
                           "trainer.total_frames=4096", "trainer.target_return=null", "logger=jsonl",
                           "logger.interval=0.2", "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = _rows(run_dir)
    assert max(r.get("collector/non_finite_skipped", 0) for r in rows[:-1]) == 1
    assert rows[-1]["summary"]["frames"] == 4096


def _can_mount_tmpfs() -> bool:
    try:
        probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                                "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


_FILL_DISK_MID_RUN = r"""
set -u
mount -t tmpfs -o size=24m tmpfs "$MNT"
"$PY" -m pipeline trainer=dqn replay=uniform replay.storage=disk replay.capacity=100000 trainer.total_frames=200000 \
    trainer.target_return=null checkpoint.interval=1 logger=jsonl logger.interval=0.3 progress=false \
    hydra.run.dir="$MNT/run" > "$OUT/stdout" 2> "$OUT/stderr" &
runner=$!
for _ in $(seq 600); do
    [ "$(cat "$MNT/run/metrics.jsonl" 2>/dev/null | wc -l)" -ge 3 ] && break
    sleep 0.1
done
dd if=/dev/zero of="$MNT/filler" bs=64k 2>/dev/null
date +%s.%N > "$OUT/filled"
wait $runner
echo $? > "$OUT/exit"
cp -r "$MNT/run" "$OUT/run"
"""


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="cannot mount a tmpfs here (no user namespaces); "
                                                  "tests/test_resume.py covers ENOSPC with a storage stub")
def test_a_disk_that_fills_up_mid_run_is_one_line_and_exit_1_with_summary_and_checkpoint(tmp_path):
    out, mnt = tmp_path / "out", tmp_path / "mnt"
    out.mkdir()
    mnt.mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "PY": sys.executable,
           "MNT": str(mnt), "OUT": str(out)}
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", _FILL_DISK_MID_RUN],
                   cwd=tmp_path, env=env, timeout=240, check=True)
    err = (out / "stderr").read_text()
    assert (out / "exit").read_text().strip() == "1", err[-3000:]
    assert "Traceback" not in err
    errors = [line for line in _lines(err) if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], err[-3000:]
    rows = _rows(out / "run")  # whole lines only: no row was cut in half
    summary = rows[-1]["summary"]
    assert summary["stop_reason"].startswith("failed: cannot write to the run directory")
    state = torch.load(out / "run" / "checkpoint.pt", weights_only=True)
    assert state["frames"] == summary["frames"] and state["stop_reason"] == summary["stop_reason"]
    assert not (out / "run" / ".disk_reserve").exists()


def test_sigterm_that_a_c_extension_wraps_in_a_system_error_still_ends_as_an_interrupted_run(tmp_path):
    # Seen in CI with workers=ray: SIGTERM landed inside ray.wait, which raised SystemError; the run left
    # with a traceback and exit 1 instead of its checkpoint, summary and 130
    run_dir = tmp_path / "wrapped"
    done = run_pipeline(["collector.post_collect_hook=tests.fakes.sigterm_inside_a_c_call", "logger=jsonl",
                         "progress=false", "trainer.target_return=null", f"hydra.run.dir={run_dir}"], tmp_path,
                        timeout=120)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    assert (run_dir / "checkpoint.pt").exists()
    summary = [r for r in _rows(run_dir) if "summary" in r]
    assert summary and "interrupted (SIGTERM)" in json.dumps(summary[-1]), summary
