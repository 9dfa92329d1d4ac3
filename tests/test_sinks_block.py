"""A sink that stops answering never stalls training, never holds up the end of a run, never costs the checkpoint.

The sinks live in a child process (:mod:`components.sinks.host`); rows reach
it through a bounded queue the driver never waits on. The stuck sinks here
are a child stopped with SIGSTOP (what a process the kernel has stopped, or
one stuck in a driver call, looks like) and ``tests.blocking_sink.BlockingSink``,
whose calls never return (a wandb service that hangs, a network file system
under ``tb/`` that blocks every write), plugged into real runs through
``logger.extra_sinks``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from components.metrics import MetricsLogger
from components.sinks.host import SinkHost
from tests.conftest import ROOT, assert_group_gone

#: a row about the size of a real one (~2 KB): 10000 of them are far more than any pipe holds
BIG_ROW = {f"train/key_{i}": float(i) for i in range(60)} | {"collector/bound": "env" * 200}
RECORDING = "tests.blocking_sink.RecordingSink"
BLOCKING = "tests.blocking_sink.BlockingSink"


def _in_thread(work, timeout: float) -> tuple[bool, list[BaseException]]:  # noqa: ANN001
    """Run ``work`` in a daemon thread; (finished within ``timeout``, what it raised)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - reported to the test
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), errors


def _kill(host: SinkHost) -> None:
    """Whatever a failed test left: the child continued (if stopped) and gone."""
    process = host._process
    if process.is_alive():
        try:
            os.kill(process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        process.kill()
        process.join(5)


def test_sending_never_blocks_on_a_stopped_sink_process_and_close_abandons_it_within_its_timeout(tmp_path, capsys):
    host = SinkHost([("recording", RECORDING, (tmp_path,), {})])
    try:
        host.attr("recording", "log_dir", 30)  # it opened
        assert host.names == ["recording"]
        os.kill(host._process.pid, signal.SIGSTOP)
        slowest: list[float] = []

        def send_many() -> None:
            for frames in range(10_000):
                started = time.perf_counter()
                host.send("log", BIG_ROW, frames)
                slowest.append(time.perf_counter() - started)

        done, errors = _in_thread(send_many, timeout=15)
        assert done and not errors, "a send waited for the stopped child"
        assert max(slowest) < 0.5 and sum(slowest) < 5
        assert 10_000 - 256 <= host.dropped < 10_000
        started = time.monotonic()
        done, errors = _in_thread(lambda: host.close(0, 1.0), timeout=10)
        assert done and not errors and time.monotonic() - started < 4
        assert not host._process.is_alive()
    finally:
        _kill(host)
    err = capsys.readouterr().err.splitlines()
    assert sum("rows behind" in line for line in err) == 1, err
    assert err.count("warning: logger sink recording failed (it did not answer within 1 s; its process was killed); "
                     "the run goes on without it") == 1, err
    assert len(err) == 2, err
    deadline = time.monotonic() + 5
    while any(t.name.startswith("QueueFeeder") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name.startswith("QueueFeeder") for t in threading.enumerate()), "the feeder thread ended"


def test_close_abandons_a_sink_that_blocks_forever_far_behind_its_rows(tmp_path, capsys):
    host = SinkHost([("blocking", BLOCKING, (tmp_path,), {})])
    started = None
    try:
        host.attr("blocking", "log_dir", 30)

        def log_then_close() -> None:
            nonlocal started
            for frames in range(1000):  # the first row blocks the sink; the rest fill any pipe many times
                host.send("log", BIG_ROW, frames)
            host.summary({"frames": 1000})
            started = time.monotonic()
            host.close(0, 1.5)

        done, errors = _in_thread(log_then_close, timeout=20)
        assert done and not errors, "sending or closing waited for the blocked sink"
        assert started is not None and time.monotonic() - started < 1.5 + 2.5
        assert not host._process.is_alive() and host.names == []
    finally:
        _kill(host)
    err = capsys.readouterr().err
    assert err.count("warning: logger sink blocking failed (it did not answer within 1.5 s") == 1, err


_NEVER_CLOSED = """
import sys
from pathlib import Path
from components.sinks.host import SinkHost
if __name__ == "__main__":
    host = SinkHost([("recording", "tests.blocking_sink.RecordingSink", (Path(sys.argv[1]),), {})])
    host.send("log", {"x": 1.0}, 1)
    host.attr("recording", "log_dir", 30)
    print("leaving without close", flush=True)
"""


def test_a_host_never_closed_does_not_hold_up_the_exit_of_its_process(tmp_path):
    """An error between the sinks' start and the run's clean-up: the interpreter must still exit."""
    script = tmp_path / "never_closed.py"
    script.write_text(_NEVER_CLOSED)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the process never exited: multiprocessing waited for the sinks process")
    assert proc.returncode == 0 and "leaving without close" in out, err
    assert_group_gone(proc.pid, within=5)


def test_dropped_rows_are_counted_in_the_rows_and_the_summary_still_reaches_a_sink_that_catches_up(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, sinks=["jsonl"], extra_sinks=[RECORDING], queue_rows=4, wandb_timeout=20)
    host = logger._host
    try:
        host.attr(RECORDING, "log_dir", 30)
        os.kill(host._process.pid, signal.SIGSTOP)
        for frames in range(1, 21):
            logger.log({"train/loss": 0.5}, frames=frames)
        logger.summary({"frames": 20})
        os.kill(host._process.pid, signal.SIGCONT)
        logger.close()
    finally:
        _kill(host)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 21, "metrics.jsonl has every row and the summary"
    assert [r["logger/dropped_rows"] for r in rows[:6]] == [0, 0, 0, 0, 0, 1]
    assert rows[-1]["summary"]["logger/dropped_rows"] == 16
    recorded = [json.loads(line) for line in (tmp_path / "recorded.jsonl").read_text().splitlines()]
    assert [next(iter(r)) for r in recorded] == ["row"] * 4 + ["summary", "close"], "the summary waited for room"
    assert recorded[-2]["summary"]["frames"] == 20
    assert capsys.readouterr().err.count("rows behind") == 1


def test_any_exception_in_a_clean_up_step_is_one_line_and_the_next_step_runs(capsys):
    from pipeline.runner.run import _best_effort

    lost: list[str] = []
    ran = []
    with _best_effort(lost, "write the final checkpoint"):
        raise RuntimeError("pickling failed\nsecond line")
    with _best_effort(lost, "write the summary"):
        ran.append("summary")
    with _best_effort(lost, "close the logger"):
        raise OSError(28, "No space left on device")
    assert ran == ["summary"]
    assert lost == ["write the final checkpoint (RuntimeError: pickling failed)",
                    "close the logger ([Errno 28] No space left on device)"]
    assert capsys.readouterr().err.splitlines() == [
        "warning: could not write the final checkpoint: RuntimeError: pickling failed",
        "warning: could not close the logger: [Errno 28] No space left on device"]


def _start(run_dir: Path, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    """``python -m pipeline`` with the blocking sink, a row every trainer step; stdout/stderr to files (never full)."""
    out, err = run_dir.parent / f"{run_dir.name}.out", run_dir.parent / f"{run_dir.name}.err"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "workers=thread", "logger=jsonl", f"logger.extra_sinks=[{BLOCKING}]",
             "logger.queue_rows=8", "logger.interval=0.001", "trainer.frames_per_batch=32", "trainer.epochs=1",
             "trainer.target_return=null", "checkpoint.interval=null", "progress=false", f"hydra.run.dir={run_dir}",
             *args], cwd=run_dir.parent, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    return proc, out, err


def _rows(run_dir: Path) -> tuple[list[dict], dict | None]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return [], None
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:  # a row being written
            break
    rows = [r for r in parsed if "summary" not in r]
    summaries = [r["summary"] for r in parsed if "summary" in r]
    return rows, summaries[-1] if summaries else None


def _wait_for(proc: subprocess.Popen, ready, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"{what}: not within {timeout} s (exit code {proc.poll()})")


def _warnings(err: Path) -> list[str]:
    """The logger's warning lines (others, e.g. a worker slowed by the loaded machine, are not this test's)."""
    text = err.read_text()
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.splitlines() if line.startswith("warning:") and "logger" in line]


def _socket_buffers() -> int:
    """What a ``multiprocessing.Pipe()`` (a Unix socket pair) holds before a send blocks: both buffers."""
    total = 0
    for name in ("wmem_default", "rmem_default"):
        try:
            total += int(Path(f"/proc/sys/net/core/{name}").read_text())
        except (OSError, ValueError):
            total += 212992
    return total


def _past_a_full_pipe(rows: list[dict]) -> bool:
    """More rows than the old pipe to the sinks held: where a blocking send stopped the run."""
    return sum(len(pickle.dumps(("log", row, row["frames"]))) for row in rows) > _socket_buffers()


def test_a_run_with_a_sink_that_blocks_forever_trains_to_its_budget_and_exits_0(tmp_path):
    run_dir = tmp_path / "blocked"
    proc, _, err = _start(run_dir, "trainer.total_frames=12800", "logger.wandb_timeout=2")
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err.read_text()[-3000:]
    assert_group_gone(proc.pid, within=5)
    rows, summary = _rows(run_dir)
    assert summary is not None and summary["frames"] == 12800 and summary["stop_reason"] == "total_frames"
    assert _past_a_full_pipe(rows), f"only {len(rows)} rows"
    assert rows[-1]["frames"] == 12800
    assert max(r["logger/dropped_rows"] for r in rows) > 0 and summary["logger/dropped_rows"] > 0
    from pipeline.runner.state import load_run_state

    assert load_run_state(run_dir / "checkpoint.pt")["frames"] == 12800
    warnings = _warnings(err)
    assert sum("rows behind" in line for line in warnings) == 1, warnings
    assert sum("did not answer within 2 s" in line for line in warnings) == 1, warnings
    assert len(warnings) == 2, warnings


def _interrupted_run(tmp_path: Path, wandb_timeout: float) -> tuple[subprocess.Popen, Path, Path]:
    run_dir = tmp_path / "interrupted"
    proc, _, err = _start(run_dir, "trainer.total_frames=100000000", f"logger.wandb_timeout={wandb_timeout}")
    def blocked() -> bool:  # the sink is stuck and the queue full: rows are being dropped, training goes on
        rows = _rows(run_dir)[0]
        return sum(r.get("logger/dropped_rows", 0) > 0 for r in rows) >= 20

    _wait_for(proc, blocked, 90, "rows dropped for the stuck sink")
    return proc, run_dir, err


def _check_interrupted_run(proc: subprocess.Popen, run_dir: Path, sent: float) -> None:
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - sent < 10, "the run took more than 10 s to end after Ctrl-C"
    assert proc.returncode == 130
    assert_group_gone(proc.pid, within=5)
    rows, summary = _rows(run_dir)
    assert summary is not None and summary["stop_reason"].startswith("interrupted")
    assert max(r["logger/dropped_rows"] for r in rows) > 0
    from pipeline.runner.state import load_run_state

    assert load_run_state(run_dir / "checkpoint.pt")["frames"] == summary["frames"] > 0


def test_ctrl_c_with_a_sink_that_blocks_forever_ends_within_10_s_with_a_checkpoint_and_a_summary(tmp_path):
    proc, run_dir, err = _interrupted_run(tmp_path, wandb_timeout=3)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _check_interrupted_run(proc, run_dir, time.monotonic())
    warnings = _warnings(err)
    assert sum("did not answer within 3 s" in line for line in warnings) == 1, warnings


def test_more_ctrl_c_during_the_clean_up_keep_the_checkpoint_and_the_last_one_abandons_the_sinks(tmp_path):
    """A second Ctrl-C while the checkpoint is written is ignored; one while the sinks close abandons them at once."""
    proc, run_dir, err = _interrupted_run(tmp_path, wandb_timeout=60)
    os.killpg(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)  # impatient: during the collector's shutdown, the checkpoint or the close
    # Where the second one lands depends on the machine's speed: before the summary it must be ignored, during
    # the sinks' close it abandons them. Either way the run ends with its checkpoint and summary.
    closing = lambda: "(Ctrl-C abandons them)" in err.read_text()  # noqa: E731
    deadline = time.monotonic() + 8
    while proc.poll() is None and not closing() and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None:
        assert closing(), "the run neither ended nor said what its close waits for within 8 s"
        os.killpg(proc.pid, signal.SIGINT)  # the sinks are closing (they would get 60 s): stop waiting for them
    _check_interrupted_run(proc, run_dir, sent)
    warnings = _warnings(err)
    assert sum("could not close the logger: interrupted" in line for line in warnings) == 1, warnings


@pytest.mark.parametrize(("override", "message"), [
    ("logger.queue_rows=0", "logger.queue_rows=0: must be >= 1 rows"),
    ("logger.extra_sinks=[mysink]", "logger.extra_sinks: 'mysink' is not a module.Class path"),
    ("logger.extra_sinks=[a.B,a.B]", "logger.extra_sinks=['a.B', 'a.B']: a sink is listed twice"),
])
def test_the_sink_queue_and_extra_sinks_are_checked_before_the_run(override, message):
    from pipeline.plan.validate import ConfigError, validate
    from tests.conftest import compose

    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        validate(compose(override), cuda_available=False, cuda_count=0)
