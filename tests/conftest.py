"""Shared fixtures: leak checks after every test, config composition, subprocess runs."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"

#: Thread names the project starts; none may outlive a test.
_OUR_THREADS = ("env-worker", "inference-server", "server-commands", "replay-writer")


def _our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(_OUR_THREADS) and t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves one of our threads or a child process behind (after reaping them).

    Only what the test itself started counts: a thread that cannot be
    reaped (one stuck for good) fails the test that leaked it, not every
    test after it.
    """
    before_children = {p.pid for p in mp.active_children()}
    before_threads = {t.ident for t in _our_threads()}
    yield
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        threads = [t for t in _our_threads() if t.ident not in before_threads]
        children = [p for p in mp.active_children() if p.pid not in before_children]
        if not threads and not children:
            return
        time.sleep(0.05)
    for p in children:  # reap them so one failure does not cascade
        p.kill()
        p.join(1.0)
    pytest.fail(f"leaked threads {[t.name for t in threads]} / processes {[p.name for p in children]}")


def compose(*overrides: str):
    """The composed config for ``overrides`` (as ``python -m pipeline`` would see it)."""
    from pipeline.plan.inputs import compose as compose_config

    return compose_config(list(overrides))


def run_pipeline(args: list[str], cwd: Path, timeout: float = 180.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m pipeline args`` as a user would, in its own process group.

    On timeout the whole group is killed, so a hang fails the test without
    leaving processes behind.
    """
    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args],
        cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"python -m pipeline {' '.join(args)} hung for {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_for_training(proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Read ``proc``'s stdout until its first ``frames`` row; kill its group and fail if none comes."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("frames "):
            return
        if not line and proc.poll() is not None:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"the run never started training: {proc.stderr.read() if proc.stderr else ''}")


def group_alive(pgid: int) -> list[int]:
    """PIDs still alive in process group ``pgid`` (zombies excluded)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            alive.append(int(entry.name))
    return alive


def assert_group_gone(pgid: int, within: float = 10.0) -> None:
    """Fail if a process of group ``pgid`` is still alive after ``within`` seconds (then kill them)."""
    deadline = time.monotonic() + within
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = group_alive(pgid)
    if left:
        os.killpg(pgid, signal.SIGKILL)
    assert not left, f"processes outlived the run: {left}"


def sample_while_writing(buffer: Any, parts: list[Any], batch_size: int, check: Callable[[Any], None]) -> int:
    """Extend ``buffer`` with ``parts`` from a writer thread while the caller samples,
    checks every sample and updates priorities; returns the number of samples.

    Fails if the writer raised or hung (joined with a timeout, even when a check fails).
    """
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for part in parts:
                buffer.extend(part)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    writer = threading.Thread(target=write, name="replay-writer-test", daemon=True)
    writer.start()
    sampled = 0
    try:
        while writer.is_alive() or sampled == 0:
            batch = buffer.sample(batch_size)
            check(batch)
            buffer.update_priorities(batch["index"], torch.rand(batch_size))
            sampled += 1
    finally:
        writer.join(timeout=30)
    assert not writer.is_alive(), "the writer thread hung"
    assert not errors, errors
    return sampled


@pytest.fixture(scope="module")
def ray_machine_lock() -> Iterator[None]:
    """Holds a machine-wide lock for a module that starts Ray clusters, so two such modules never overlap.

    The suite runs two files at a time (pytest-xdist); the Ray modules count the machine's Ray processes.
    A file lock rather than xdist's groups: those do not take effect with pytest 9.
    """
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "rlpipeline-tests-ray.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other module ends within its tests' timeouts
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
