"""``python -m pipeline.report``: runs found and classified, panels from what was logged, a page a browser draws."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.report.page import build_page
from pipeline.report.runs import load_runs, swept_keys
from tests.conftest import ROOT, run_pipeline

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _row(frames: int, **values: float) -> dict:
    return {"frames": frames, "time": frames / 1000, "episode/return_mean": frames / 100,
            "collector/frames_per_s": 1000.0, "collector/env_frac": 0.5, "collector/infer_wait_frac": 0.3,
            "collector/chunk_wait_frac": 0.2, "server/requests_per_s": 100.0, "server/avg_batch_size": 8.0,
            "server/queue_latency_p50_ms": 0.1, "server/queue_latency_p95_ms": 0.3, "server/forward_p50_ms": 0.1,
            "server/forward_p95_ms": 0.2, "server/policy_version": frames // 256, **values}


def _fake_run(path: Path, overrides: list[str], rows: list[dict], summary: dict | None = None,
              lock_pid: int | None = None, tail: str = "") -> Path:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    lines = [json.dumps(r) for r in rows] + ([json.dumps({"summary": summary})] if summary else [])
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    if lock_pid is not None:
        import socket

        (path / ".run.lock").write_text(json.dumps({"pid": lock_pid, "host": socket.gethostname()}))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _sweep(root: Path) -> Path:
    rows = [_row(f) for f in (256, 512, 768)]
    _fake_run(root / "0", ["trainer.lr=0.001", "seed=0"], rows,
              {"frames": 768, "wall_time_s": 1.0, "stop_reason": "total_frames", "episode/return_mean": 7.0})
    _fake_run(root / "1", ["trainer.lr=0.003", "seed=0"], rows,
              {"frames": 512, "wall_time_s": 1.0, "stop_reason": "target_return", "solved": 1})
    _fake_run(root / "2", ["trainer.lr=0.01", "seed=0"], rows[:2],
              {"frames": 512, "stop_reason": "failed: env worker 0 failed: boom"})
    _fake_run(root / "3", ["trainer.lr=0.03", "seed=0"], rows[:1],
              {"frames": 256, "stop_reason": "interrupted (SIGINT)"})
    _fake_run(root / "4", ["trainer.lr=0.1", "seed=0"], rows[:2], lock_pid=os.getpid(), tail='{"frames": 76')
    _fake_run(root / "5", ["trainer.lr=0.3", "seed=0"], rows[:2], lock_pid=_dead_pid())
    return root


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file() and p.name != "report.html"}


def test_runs_are_found_and_classified_and_a_half_written_line_is_skipped(tmp_path):
    runs = {r.name: r for r in load_runs(_sweep(tmp_path))}
    assert {n: r.status for n, r in runs.items()} == {"0": "finished", "1": "solved", "2": "failed",
                                                        "3": "interrupted", "4": "running", "5": "failed"}
    assert runs["4"].skipped_lines == 1 and len(runs["4"].rows) == 2
    assert runs["5"].stop_reason == "ended without a summary (killed?)"
    assert runs["0"].final_return == 7.0 and runs["0"].frames_per_s == 768.0
    assert swept_keys(list(runs.values())) == ["trainer.lr"]


def test_panels_follow_what_was_logged(tmp_path):
    runs = load_runs(_sweep(tmp_path))
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', build_page(runs, "t")).group(1))
    assert meta["panels"] == ["return-vs-frames", "return-vs-time", "frames-per-s", "server", "workers", "sweep"]
    assert meta["swept"] == ["trainer.lr"]
    (tmp_path / "0" / "metrics.jsonl").write_text(json.dumps({**_row(256), "replay/size": 256, "replay/sampled": 0})
                                                  + "\n")
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', build_page(load_runs(tmp_path / "0"), "t"))
                      .group(1))
    assert "replay" in meta["panels"] and "sweep" not in meta["panels"]
    bare = tmp_path / "bare"
    _fake_run(bare, [], [{"frames": 10, "time": 0.1}])
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', build_page(load_runs(bare), "t")).group(1))
    assert meta["panels"] == [], "no keys, no panels, no crash"


def test_the_command_writes_only_report_html_and_refuses_empty_paths(tmp_path):
    root = _sweep(tmp_path / "sweep")
    before = _digest(root)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pipeline.report", str(root)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(str(root / "report.html"))
    assert _digest(root) == before and sorted(p.name for p in root.iterdir() if p.is_file()) == ["report.html"]
    page = (root / "report.html").read_text()
    assert not re.search(r"<(script|link)[^>]+(src|href)=", page), "self-contained: nothing loaded from elsewhere"
    assert "Plotly" in page
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([sys.executable, "-m", "pipeline.report", str(empty)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 1 and done.stderr.strip() == f"error: {empty}: no runs there (no metrics.jsonl below it)"
    assert not (empty / "report.html").exists()


def test_serve_rebuilds_the_page_while_a_run_is_writing(tmp_path):
    root = _sweep(tmp_path / "sweep")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.report", str(root), "--serve", "--port", "0",
                             "--every", "0.3"], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        url = re.search(r"(http://127\.0\.0\.1:\d+/report\.html)", proc.stdout.readline()).group(1)
        with urllib.request.urlopen(url, timeout=10) as response:
            first = response.read().decode()
        assert "6 run(s)" in first and 'http-equiv="refresh"' in first
        with open(root / "4" / "metrics.jsonl", "a") as fh:  # the running run logs on
            fh.write('8}\n' + json.dumps(_row(1024)) + "\n")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=10) as response:
                page = response.read().decode()
            if "1,024" in page:
                break
            time.sleep(0.2)
        assert "1,024" in page, "the rebuilt page shows the new row"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(10)


def dump_dom(page: Path) -> str:
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000",
                           "--run-all-compositor-stages-before-draw", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_a_real_sweep_report_renders_every_panel_in_a_browser(tmp_path):
    result = run_pipeline(["-m", "seed=0,1", "trainer.total_frames=3000", "trainer.target_return=null",
                           "logger=jsonl", "logger.interval=0.2", "progress=false",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pipeline.report", str(tmp_path / "sweep")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    dom = dump_dom(tmp_path / "sweep" / "report.html")
    assert re.search(r'<div id="js-errors"></div>', dom), "no JavaScript error"
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', dom).group(1))
    assert meta["panels"] == ["return-vs-frames", "return-vs-time", "frames-per-s", "server", "workers", "sweep"]
    assert re.search(rf'data-rendered="{len(meta["panels"])}"', dom), "every plot drew its SVG"
    for panel in meta["panels"]:
        section = dom.split(f'id="{panel}"', 1)[1].split("</section>", 1)[0]
        assert 'class="main-svg"' in section, panel
    curves = dom.split('id="return-vs-frames"', 1)[1].split("</section>", 1)[0]
    assert curves.count('class="trace scatter') == 2, "one return curve per run"
    table = dom.split('id="runs-table"', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr data-status=\"finished\"") == 2


def test_ctrl_c_stops_the_server_even_when_started_with_sigint_ignored(tmp_path):
    """A shell starts background jobs (``cmd &``, nohup) with SIGINT ignored; the server still stops on it."""
    root = _sweep(tmp_path / "sweep")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.report", str(root), "--serve", "--port", "0"],
                            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert "serving" in proc.stdout.readline()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
