"""Frozen parts: a worker or server that is alive but makes no progress is found, named and replaced.

A SIGSTOPped process stands for any freeze the old step watchdog could not
see (a deadlock outside ``env.step``, a process stopped by the kernel or a
debugger): it stays alive, answers nothing and never crashes. Real runs,
real signals; every test is bounded in time and leaves nothing behind
(the stopped process gets SIGCONT, then the group is killed). The last tests
check the other side: slow but live parts and a slow trainer are not hangs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from components.collector.collector import AsyncBatchedCollector, CollectorError, GraphSpec
from components.collector.worker_control import TIMING
from components.envs import GymEnvFactory, probe_env_spec
from components.models import ModelSpec
from tests.conftest import ROOT, assert_group_gone
from tests.fakes import SlowEnvFactory
from tests.procs import spawned_children

TIMEOUT = 3  # workers.step_timeout and server.step_timeout of every run here
#: Each paced env step sleeps this long: a run's frame rate is bounded and its length predictable.
PACE = ["env.factory._target_=tests.fakes.SlowEnvFactory", "+env.factory.delay=0.004"]
SMALL_MLP = ModelSpec("components.models.ActorCritic", {"hidden": [16]})


def _state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (None: gone; 'Z': dead, not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


#: futex(2): where a process waits on a semaphore (x86_64, aarch64)
_FUTEX = "202" if os.uname().machine == "x86_64" else "98"


def _syscall(pid: int) -> str | None:
    """The number of the system call ``pid`` is stopped in ('-1': in user space; None: cannot tell)."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return None


def _find(runner: int, what: str) -> int:
    """The pid of the run's server process, or of one of its worker processes.

    Children are named (``infer-server``, ``env-worker-N``) for ps; unnamed
    ones (an older tree) are told apart by age: the server starts first.
    """
    started = time.monotonic()
    while time.monotonic() - started < 60:
        kids = spawned_children(runner)
        named = [pid for _, pid, name in kids if name == ("infer-server" if what == "server" else "env-worker-0")]
        if named:
            return named[0]
        unnamed = [pid for _, pid, name in kids if name == "python"]
        if unnamed and time.monotonic() - started > 0.5:  # training began: ours are named by now
            return unnamed[0] if what == "server" else unnamed[-1]
        time.sleep(0.05)
    raise AssertionError(f"no {what} process of run {runner} appeared")


class Run:
    """``python -m pipeline`` in its own process group, stderr in a file read as it grows."""

    def __init__(self, tmp_path: Path, args: list[str]) -> None:
        self.dir = tmp_path / "run"
        self.err_path = tmp_path / "stderr.txt"
        env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT)}
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline", *args, "logger=jsonl", "logger.interval=0.5", "progress=false",
                 "trainer.target_return=null", "transport=slots", f"hydra.run.dir={self.dir}"],
                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True, start_new_session=True)
        self.stopped: list[int] = []

    @property
    def err(self) -> str:
        return self.err_path.read_text()

    def rows(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_training(self) -> None:
        deadline = time.monotonic() + 90
        while len(self.rows()) < 1:
            assert self.proc.poll() is None, f"the run ended early: {self.err[-2000:]}"
            assert time.monotonic() < deadline, "the run never started training"
            time.sleep(0.05)

    def freeze(self, pid: int, outside_step: bool = False) -> float:
        """SIGSTOP ``pid``; returns when the freeze counts from (monotonic).

        With ``outside_step`` the process is frozen where the old step
        watchdog was blind: waiting on a semaphore (for a free chunk or for
        actions), never inside ``env.step``. The driver is stopped for a
        moment so that it takes no chunks and every worker soon waits for one;
        the freeze counts from the driver's resumption.
        """
        self.stopped.append(pid)
        if not outside_step:
            os.kill(pid, signal.SIGSTOP)
            return time.monotonic()
        os.kill(self.proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            for _ in range(500):
                os.kill(pid, signal.SIGSTOP)
                while _state(pid) not in ("T", "t", None, "Z"):
                    time.sleep(0.001)
                if _syscall(pid) == _FUTEX:
                    break
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.01)
            else:
                raise AssertionError(f"process {pid} never waited on a semaphore")
            time.sleep(max(0.0, 1.5 - (time.monotonic() - stopped_at)))  # a stop the driver notices (over 1 s)
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)
        return time.monotonic()

    def wait_for_line(self, pattern: str, count: int, timeout: float) -> float:
        """Seconds until stderr holds ``count`` lines matching ``pattern`` (fails after ``timeout``)."""
        started = time.monotonic()
        while len(re.findall(pattern, self.err)) < count:
            assert self.proc.poll() is None, f"the run ended: {self.err[-3000:]}"
            assert time.monotonic() - started < timeout, f"no {pattern!r} within {timeout} s: {self.err[-3000:]}"
            time.sleep(0.02)
        return time.monotonic() - started

    def finish(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        for pid in self.stopped:
            if _state(pid) is not None:
                os.kill(pid, signal.SIGCONT)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        assert_group_gone(self.proc.pid)


def _wait_killed(pid: int, frozen_at: float, limit: float) -> float:
    """Seconds from ``frozen_at`` until the frozen ``pid`` was killed by the watchdog (fails after ``limit``)."""
    while _state(pid) not in (None, "Z"):
        assert time.monotonic() - frozen_at < limit, f"the frozen process {pid} was still there after {limit} s"
        time.sleep(0.02)
    return time.monotonic() - frozen_at


WORKER_RESTARTED = (r"warning: env worker 0 \(envs 0-1\) restarted with fresh envs .*: env worker 0 \(envs 0-1\) "
                    r"hung: no progress for \d+ s, last seen waiting for (actions|a free chunk)"
                    r".*its process was stopped")
SERVER_RESTARTED = r"warning: inference server \(process\) restarted .*? in ([\d.]+) s .*hung: no progress .*stopped"


@pytest.mark.parametrize(("workers", "server", "targets"), [
    ("process", "process", ("worker", "server")),  # a worker frozen beside a thread server is the same watchdog
    ("process", "inline", ("worker",)),
    ("thread", "process", ("server",)),
])
def test_a_sigstopped_process_is_killed_and_restarted_and_the_run_ends_well(tmp_path, workers, server, targets):
    """Each process of the layout, frozen in turn: restarted within its step_timeout + 2 s, the run exits 0."""
    # Paced at <= 250 frames/s per worker: a worker's freeze and restart (~4 s, the other worker going on) leave
    # well over half of the budget; a frozen server stops every frame, so a second freeze fits too.
    frames = 2560
    args = [*PACE, f"workers={workers}", f"server={server}", "env.num_envs=4", "env.envs_per_worker=2",
            f"workers.step_timeout={TIMEOUT}", "workers.max_restarts=1", f"trainer.total_frames={frames}"]
    if "server" in targets:
        args += [f"server.step_timeout={TIMEOUT}", "server.max_restarts=1"]
    run = Run(tmp_path, args)
    try:
        run.wait_for_training()
        for target in targets:
            pid = _find(run.proc.pid, target)
            frozen_at = run.freeze(pid, outside_step=target == "worker")
            assert _wait_killed(pid, frozen_at, TIMEOUT + 2) > TIMEOUT - 0.5, "not before its step_timeout"
            if target == "worker":
                assert run.wait_for_line(WORKER_RESTARTED, 1, 5) < 5
                assert time.monotonic() - frozen_at < TIMEOUT + 2
            else:
                run.wait_for_line(SERVER_RESTARTED, 1, 60)
                # the watchdog acted within step_timeout + 2 s (above); the new server then took its start-up time
                startup = float(re.findall(SERVER_RESTARTED, run.err)[0])
                assert time.monotonic() - frozen_at < TIMEOUT + 2 + startup + 1
        code = run.finish()
        err = run.err
        assert code == 0, err[-3000:]
    finally:
        run.close()
    rows = run.rows()
    assert rows[-1]["summary"]["frames"] == frames
    restarts = {k: max(r.get(f"collector/{k}", 0) for r in rows[:-1]) for k in ("worker_restarts", "server_restarts")}
    assert restarts == {"worker_restarts": int("worker" in targets), "server_restarts": int("server" in targets)}
    assert "error:" not in err and "Traceback" not in err


def _collector(graph: GraphSpec, factory, total: int = -1, **options) -> AsyncBatchedCollector:  # noqa: ANN001
    return AsyncBatchedCollector(factory, SMALL_MLP, graph, frames_per_batch=32, total_frames=total, seed=3,
                                 env_spec=probe_env_spec(GymEnvFactory("CartPole-v1")), **options)


def test_a_frozen_thread_worker_stops_the_run_with_one_line_naming_what_it_waited_on(monkeypatch):
    """A thread cannot be killed: frozen outside an env step (here: taking a chunk), it ends the run at once."""
    from components.collector import chunks

    release = threading.Event()
    acquire = chunks.ChunkWriter.acquire
    calls = {"n": 0}

    def frozen_acquire(self, timeout):  # noqa: ANN001, ANN202
        if self.worker == 1:
            calls["n"] += 1
            if calls["n"] > 3:
                release.wait(60)  # a deadlock: never returns while the test runs
                return None
        return acquire(self, timeout)

    monkeypatch.setattr(chunks.ChunkWriter, "acquire", frozen_acquire)
    graph = GraphSpec("thread", "thread", num_envs=4, envs_per_worker=2, chunk_len=2)
    collector = _collector(graph, GymEnvFactory("CartPole-v1"), step_timeout=2.0, stall_timeout=30.0,
                           max_restarts=1).start()
    try:
        started = time.monotonic()
        with pytest.raises(CollectorError) as caught:
            while time.monotonic() - started < 2.0 + 2:  # worker 0 goes on: batches keep coming
                collector.next_batch()
        message = str(caught.value)
        assert "\n" not in message
        assert re.match(r"env worker 1 \(envs 2-3\) hung: no progress for \d s, last seen waiting for a free chunk "
                        r".*workers.step_timeout=2.*a thread cannot be killed", message), message
    finally:
        release.set()
        collector.shutdown()


def test_a_slow_workers_time_and_frames_reach_the_monitor_before_its_chunk_is_full():
    """Steps of 0.1 s in chunks of 64: the counts are stored as they accrue, not once a 6.4 s chunk.

    The monitor's intervals (env time, frames per worker, the slowest worker)
    read these counts; stored once a chunk, a slow env's were zero for whole
    intervals and then a lump.
    """
    graph = GraphSpec("thread", "thread", num_envs=2, envs_per_worker=1, chunk_len=64, chunks_per_worker=2)
    collector = _collector(graph, SlowEnvFactory(0.1)).start()
    try:
        timing = collector._control.timing
        env_s, frames = TIMING.index("env_s"), TIMING.index("frames")
        deadline = time.monotonic() + 30
        while timing[:, TIMING.index("steps")].min() < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = timing.copy()
    finally:
        collector.shutdown()
    assert got[:, TIMING.index("steps")].min() >= 10, "each worker took 10 steps within 30 s"
    assert (got[:, frames] >= 8).all(), got  # flushed at most 0.1 s (one step) behind
    assert (got[:, env_s] >= 0.8).all(), got


def test_a_slow_worker_is_reported_and_never_counted_as_a_hang(tmp_path, capfd):
    """One env sleeping 0.3 s per step (step_timeout 3): slowest_worker names it, one warning, no restart."""
    # enough chunks that the fast workers fill batches on their own (else the slow one paces them all)
    graph = GraphSpec("thread", "thread", num_envs=4, envs_per_worker=1, chunk_len=2, chunks_per_worker=32)
    factory = SlowEnvFactory(0.3, once=str(tmp_path / "slow"))  # the first env built is the slow one
    collector = _collector(graph, factory, step_timeout=3.0, max_restarts=1).start()
    try:
        assert (tmp_path / "slow").exists()
        stats = []
        deadline = time.monotonic() + 30
        while len(stats) < 3 and time.monotonic() < deadline:
            interval_end = time.monotonic() + 1.2
            while time.monotonic() < interval_end:
                collector.next_batch()
            stats.append(collector.worker_stats())
        beats = collector._control.beats.copy()
    finally:
        collector.shutdown()
    assert len(stats) == 3
    slowest = {s["slowest_worker"] for s in stats[1:]}
    assert len(slowest) == 1 and all(s["slowest_worker_ratio"] < 0.25 for s in stats[1:]), stats
    assert all(s["worker_restarts"] == 0 for s in stats)
    assert beats.min() > 3, "the slow worker beats between its steps"
    err = capfd.readouterr().err
    worker = slowest.pop()
    warnings = [line for line in err.splitlines() if "is slow" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"warning: env worker {worker} (envs {worker}-{worker}) is slow")
    assert "hung" not in err and "restarted" not in err


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_slow_trainer_is_backpressure_not_a_hang(workers):
    """The consumer sleeps past step_timeout between batches: workers wait for chunks, beating, and live on."""
    graph = GraphSpec(workers, "thread", num_envs=4, envs_per_worker=2, chunk_len=2)
    collector = _collector(graph, GymEnvFactory("CartPole-v1"), step_timeout=1.0, max_restarts=1).start()
    try:
        collector.next_batch()
        for _ in range(2):
            beats = collector._control.beats.copy()
            time.sleep(2.0)  # a long trainer update: every chunk is held, the workers wait for one
            assert (collector._control.beats > beats).all(), "waiting workers beat"
            collector.next_batch()
        collector.next_batch()
        stats = collector.worker_stats()
    finally:
        collector.shutdown()
    assert stats["worker_restarts"] == 0 and stats["chunk_wait_frac"] > 0.5


def test_a_run_stopped_and_resumed_whole_is_not_a_hang(tmp_path):
    """Ctrl-Z then ``fg``: every process of the run stopped past every step_timeout, then resumed: nothing restarted."""
    run = Run(tmp_path, [*PACE, "workers=process", "server=process", "env.num_envs=4", "env.envs_per_worker=2",
                         f"workers.step_timeout={TIMEOUT}", f"server.step_timeout={TIMEOUT}",
                         "trainer.total_frames=1536"])
    try:
        run.wait_for_training()
        os.killpg(run.proc.pid, signal.SIGSTOP)
        time.sleep(TIMEOUT + 2)
        os.killpg(run.proc.pid, signal.SIGCONT)
        code = run.finish()
        err = run.err
    finally:
        run.close()
    assert code == 0, err[-3000:]
    rows = run.rows()
    assert rows[-1]["summary"]["frames"] == 1536
    assert all(r.get("collector/worker_restarts", 0) == 0 and r.get("collector/server_restarts", 0) == 0
               for r in rows[:-1]), err[-3000:]
    assert "hung" not in err and "restarted" not in err and "stalled" not in err


def test_server_step_timeout_must_be_positive_or_null():
    from pipeline.plan.validate import ConfigError, validate
    from tests.conftest import compose

    for server in ("thread", "process", "inline"):
        validate(compose(f"server={server}", "server.step_timeout=null"), cuda_available=False)
        assert compose(f"server={server}").server.step_timeout == 60.0
    for value in ("0", "-1", "abc"):
        with pytest.raises(ConfigError if value != "abc" else Exception, match=r"server.step_timeout"):
            validate(compose("server=process", f"server.step_timeout={value}"), cuda_available=False)


def _monitor_over(env_s: list[float], frames: list[int], wall: float = 1.0) -> tuple[Any, list[str]]:
    """A GraphMonitor over a fake control block: two intervals in which worker w stepped ``env_s[w]`` s."""
    import types

    from components.collector.monitor import GraphMonitor
    from components.collector.worker_control import TIMING

    n = len(env_s)
    control = types.SimpleNamespace(timing=np.zeros((n, len(TIMING))), beats=np.zeros(n, np.int64))
    monitor = GraphMonitor(control, None, None, [(w, w) for w in range(n)], None)
    lines: list[str] = []
    for interval in range(3):
        monitor._timing_mark = (time.monotonic() - wall, control.timing.copy()) if interval else None
        control.timing[:, TIMING.index("env_s")] += env_s
        control.timing[:, TIMING.index("frames")] += frames
        control.beats += 10  # every worker turned its loop
        out = monitor.worker_stats()
        lines.append(str(out.get("slowest_worker")))
    return monitor, lines


def test_a_worker_that_mostly_waited_is_not_warned_about_as_slow(capfd):
    """Starved (waiting for actions or chunks) is not slow envs: the ratio is logged, no warning."""
    _, slowest = _monitor_over(env_s=[0.9, 0.9, 0.9, 0.05], frames=[1000, 1000, 1000, 10])
    assert slowest[1:] == ["3", "3"]
    assert "is slow" not in capfd.readouterr().err
    _, slowest = _monitor_over(env_s=[0.9, 0.9, 0.9, 0.95], frames=[1000, 1000, 1000, 10])
    assert "warning: env worker 3 (envs 3-3) is slow" in capfd.readouterr().err
