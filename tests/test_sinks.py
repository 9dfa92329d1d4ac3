"""Metric sinks: metrics.jsonl always, TensorBoard with the same keys, wandb that may fail without harm."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from components.metrics import MetricsLogger, check_sinks, overrides_dict
from tests.conftest import run_pipeline

ROWS = [{"train/loss": 0.5, "episode/return_mean": 10.0, "collector/bound": "env"},
        {"train/loss": 0.25, "episode/return_mean": 30.0, "collector/bound": "env"}]


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_the_same_numeric_keys_as_the_jsonl_rows_and_hparams(tmp_path):
    logger = MetricsLogger(tmp_path, sinks=["jsonl", "tensorboard"], run_config={"trainer": {"lr": 0.001}},
                           overrides=["trainer.lr=0.001", "seed=3", "hydra.run.dir=x"])
    for frames, row in zip((256, 512), ROWS):
        logger.log(row, frames=frames)
    logger.summary({"frames": 512, "episode/return_mean": 30.0, "wall_time_s": 1.5, "stop_reason": "total_frames"})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars = _scalars(tmp_path / "tb")
    numeric = {k for row in rows[:-1] for k, v in row.items() if k != "frames" and isinstance(v, float)}
    assert numeric <= set(scalars), "every numeric JSONL key is a TensorBoard scalar"
    assert scalars["train/loss"] == [(256, 0.5), (512, 0.25)]
    assert scalars["hparam/episode/return_mean"] == [(512, 30.0)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "hparams" in acc.PluginTagToContent("hparams") or acc.PluginTagToContent("hparams")
    assert acc.Tags()["tensors"], "the config text is there"


def test_a_failing_wandb_is_one_warning_and_the_other_sinks_go_on(tmp_path, monkeypatch, capsys):
    from components.sinks import wandb_run

    def broken_log(self, row, frames):  # noqa: ANN001, ANN202
        raise RuntimeError("wandb internal error\nwith a second line")

    monkeypatch.setattr(wandb_run.WandbSink, "log", broken_log)
    logger = MetricsLogger(tmp_path, sinks=["jsonl", "tensorboard", "wandb"], mode="offline")
    assert logger.sinks == ["jsonl", "tensorboard", "wandb"]
    for frames, row in zip((256, 512), ROWS):
        logger.log(row, frames=frames)
    logger.summary({"frames": 512})
    logger.close()
    err = capsys.readouterr().err
    assert err.count("warning: logger sink wandb failed (RuntimeError: wandb internal error)") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert _scalars(tmp_path / "tb")["train/loss"] == [(256, 0.5), (512, 0.25)]


_ONLINE_WITHOUT_SERVER = """
import sys, time
from pathlib import Path
from components.metrics import MetricsLogger
started = time.monotonic()
logger = MetricsLogger(Path(sys.argv[1]), sinks=["jsonl", "tensorboard", "wandb"], mode="online", wandb_timeout=10)
logger.log({"train/loss": 0.5}, frames=1)
logger.summary({"frames": 1})
logger.close()
print("sinks", ",".join(logger.sinks), "seconds", round(time.monotonic() - started, 1))
"""


def test_wandb_that_cannot_reach_its_server_does_not_stop_or_hang_the_run(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WANDB_BASE_URL": f"http://127.0.0.1:{port}", "WANDB_API_KEY": "x" * 40,
           "WANDB_MODE": "online", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _ONLINE_WITHOUT_SERVER, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - started < 60
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: logger sink wandb")]
    assert len(warnings) <= 1 and "Traceback" not in done.stderr
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
    assert (tmp_path / "tb").is_dir()


def test_a_failed_jsonl_write_leaves_no_half_row_and_raises(tmp_path, monkeypatch):
    logger = MetricsLogger(tmp_path, sinks=["jsonl"])
    logger.log(ROWS[0], frames=1)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:
        if len(data) > 20:
            real_write(fd, data[:20])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError, match=r"No space left on device \(writing .*metrics.jsonl\)"):
        logger.log(ROWS[1], frames=2)
    monkeypatch.undo()
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


def test_sink_names_are_checked():
    assert check_sinks(["wandb", "tensorboard"]) == ["jsonl", "wandb", "tensorboard"]
    with pytest.raises(ValueError, match="unknown sink"):
        check_sinks(["jsonl", "mlflow"])
    with pytest.raises(ValueError, match="listed twice"):
        check_sinks(["wandb", "wandb"])
    assert overrides_dict(["+a.b=1", "hydra.job.num=2", "seed=3", "resume=x"]) == {"a.b": "1", "seed": "3"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tensorboard_serves_a_finished_runs_scalars_over_http(tmp_path):
    run_dir = tmp_path / "run"
    result = run_pipeline(["trainer.total_frames=2048", "trainer.target_return=null", "logger=tensorboard",
                           "logger.interval=0.2", "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    port = _free_port()
    board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(run_dir), "--host",
                              "127.0.0.1", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}/data/plugin/scalars"
        deadline = time.monotonic() + 90
        tags: dict = {}
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{base}/tags", timeout=5) as response:
                    tags = json.load(response)
                if tags:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        run_name, run_tags = next(iter(tags.items()))
        assert "episode/return_mean" in run_tags and "collector/frames_per_s" in run_tags
        query = urllib.parse.urlencode({"run": run_name, "tag": "episode/return_mean"})
        with urllib.request.urlopen(f"{base}/scalars?{query}", timeout=10) as response:
            points = json.load(response)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        logged = [r["frames"] for r in rows if "episode/return_mean" in r and r["episode/return_mean"] is not None]
        assert [int(p[1]) for p in points] == logged, "one point per JSONL row, at its frame count"
    finally:
        board.kill()
        board.wait(10)


class FailingSink:
    """A sink for the child process of ``in_process=False``: starts, then fails on its second row."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        self.rows = 0
        self.log_dir = run_dir / "fake"

    def log(self, row: dict, frames: int) -> None:
        self.rows += 1
        if self.rows == 2:
            raise RuntimeError("disk on fire\nsecond line")

    def summary(self, values: dict) -> None:
        pass

    def close(self, exit_code: int) -> None:
        pass


def test_sinks_in_a_child_process_get_every_row_and_report_the_wandb_id(tmp_path):
    logger = MetricsLogger(tmp_path, sinks=["jsonl", "tensorboard", "wandb"], mode="offline", in_process=False)
    try:
        for frames, row in zip((256, 512), ROWS):
            logger.log(row, frames=frames)
        run_id = logger.wandb_id
        logger.summary({"frames": 512, "episode/return_mean": 30.0})
    finally:
        logger.close()
    assert logger._host is None and run_id and len(run_id) >= 6
    assert _scalars(tmp_path / "tb")["train/loss"] == [(256, 0.5), (512, 0.25)]
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_a_sink_failing_in_the_child_is_one_warning_and_a_dead_child_loses_nothing_else(tmp_path, capsys):
    from components.sinks.host import SinkHost

    host = SinkHost([("tensorboard", "tests.test_sinks.FailingSink", (tmp_path,), {})])
    try:
        assert host.attr("tensorboard", "log_dir", 30) == str(tmp_path / "fake")
        for frames in range(1, 4):
            host.send("log", {"x": 1.0}, frames)
        deadline = time.monotonic() + 30
        while host.names and time.monotonic() < deadline:
            host.send("log", {"x": 1.0}, 9)
            time.sleep(0.05)
        assert host.names == []
    finally:
        host.close(0, 10)
    assert capsys.readouterr().err.count(
        "warning: logger sink tensorboard failed (RuntimeError: disk on fire); the run goes on without it") == 1
    logger = MetricsLogger(tmp_path / "killed", sinks=["jsonl", "tensorboard"], in_process=False)
    logger.log(ROWS[0], frames=1)
    logger._host._process.kill()
    logger._host._process.join(10)
    logger.log(ROWS[1], frames=2)
    logger.close()
    err = capsys.readouterr().err
    assert "warning: logger sink tensorboard failed (its process exited with code -9)" in err
    assert len((tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()) == 2
