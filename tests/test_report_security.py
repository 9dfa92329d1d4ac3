"""The report as an attacker meets it: crafted run directories, a hostile web page, odd files under the root.

Each test builds the hostile input by hand (as ``tests/test_report.py`` builds
fake runs) and checks what a user of a shared machine needs: injected markup
shows as text in a real browser, ``--serve`` sends the report and nothing else,
and odd files are named in the page instead of hanging or crashing it.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.report.page import build_page
from pipeline.report.runs import load_runs
from tests.conftest import ROOT
from tests.test_report import CHROMIUM, _fake_run, _row, dump_dom

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
KEY = "</script><script>Object.assign(document,{title:'pwned'})</script>"
LINK = '<a href="https://evil.example/">click</a>'
SUMMARY = {"frames": 768, "wall_time_s": 1.0, "stop_reason": "total_frames", "episode/return_mean": 7.0}


def _report(root: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.report", str(root)], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def _hostile_sweep(root: Path) -> Path:
    rows = [_row(f) for f in (256, 512, 768)]
    _fake_run(root / "a", [f"+{KEY}=1", "seed=0"], rows, SUMMARY)
    _fake_run(root / "b", [f"+{KEY}=2", "seed=0"], rows, {**SUMMARY, "stop_reason": f"failed: {KEY}"})
    _fake_run(root / "<img src=x onerror=Object.assign(document,{title:'pwned'})>", [f"+{KEY}={LINK}", "seed=0"],
              rows, SUMMARY)
    return root


def test_the_page_embeds_no_markup_from_run_directories(tmp_path):
    """Without a browser: no ``</script>`` or ``<!--`` inside any script element, the key shows escaped."""
    root = _hostile_sweep(tmp_path / "sweep")
    done = _report(root)
    assert done.returncode == 0, done.stderr
    page = (root / "report.html").read_text()
    assert KEY not in page and LINK not in page and "<img" not in page, "nothing from the runs is raw markup"
    assert "<!--" not in page
    code = re.findall(r"<script>(.*?)</script>", page, flags=re.S)
    assert len(code) == 4 and "Plotly" in code[1] and "querySelectorAll('video')" in code[3], \
        "the error hook, plotly, the page's own script and its videos' one; no other"
    meta = json.loads(re.search(r'id="report-meta">(.*?)</script>', page).group(1))
    assert meta["swept"] == [KEY], "the key itself survives, as data"
    assert "<th>&lt;/script&gt;&lt;script&gt;Object.assign(document,{title:&#x27;pwned&#x27;})&lt;/script&gt;</th>" \
        in page
    assert "Content-Security-Policy" in page


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_an_override_key_holding_a_script_renders_as_text_in_a_browser(tmp_path):
    root = _hostile_sweep(tmp_path / "sweep")
    done = _report(root)
    assert done.returncode == 0, done.stderr
    dom = dump_dom(root / "report.html")
    assert re.search(r"<title>([^<]*)</title>", dom).group(1) == "rlpipeline report: sweep", "no injected script ran"
    assert re.search(r'<div id="js-errors"></div>', dom), "no JavaScript error"
    assert re.search(r'data-rendered="\d+"', dom), "the plots still drew"
    header = "&lt;/script&gt;&lt;script&gt;Object.assign(document,{title:'pwned'})&lt;/script&gt;"
    assert f"<th>{header}</th>" in dom, "the key is a column header, as text"
    legend = re.findall(r'class="legendtext"[^>]*>([^<]*)<', dom)
    assert any(text.startswith(header) for text in legend), "plotly draws the key as text too"
    assert not re.search(r"<a\b[^>]*evil\.example", dom), "plotly made no link of a value"
    assert any("&lt;a href=" in text for text in legend), "the value shows as the text it is"


# --------------------------------------------------------------------------------------------- --serve


class _Server:
    """``python -m pipeline.report ROOT --serve --port 0 ...`` in its own session, killed on exit."""

    def __init__(self, root: Path, *extra: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.report", str(root), "--serve", "--port", "0",
                                      "--every", "600", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=ENV, start_new_session=True)

    def __enter__(self) -> "_Server":
        line = self.proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/report\.html", line)
        if not match:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            err = self.proc.stderr.read()[-2000:]
            self.__exit__()
            raise AssertionError(f"no URL printed: {line!r} {err}")
        self.port = int(match.group(1))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdout.close()
        self.proc.stderr.close()

    def get(self, path: str, host: str | None = None, method: str = "GET") -> tuple[int, bytes]:
        return _get(self.port, path, host, method)


def _get(port: int, path: str, host: str | None = None, method: str = "GET") -> tuple[int, bytes]:
    """``(status, body)`` of one request sent as written (``host=""``: no Host header at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host != "":
            conn.putheader("Host", host or f"127.0.0.1:{port}")
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _served_root(root: Path) -> Path:
    """A run directory as the root, with everything a run leaves and two planted links."""
    _fake_run(root, ["seed=0"], [_row(256)], SUMMARY)
    (root / "checkpoint.pt").write_bytes(b"weights")
    (root / ".hydra" / "config.yaml").write_text("secret: 1\n")
    (root / "replay").mkdir()
    (root / "replay" / "obs.npy").write_bytes(b"\0" * 16)
    (root / "passwd").symlink_to("/etc/passwd")
    (root / "etc").symlink_to("/etc")
    return root


def test_serve_sends_the_report_and_nothing_else(tmp_path):
    root = _served_root(tmp_path / "run")
    with _Server(root) as server:
        status, body = server.get("/report.html")
        assert status == 200 and b"rlpipeline report" in body
        assert server.get("/report.html", method="HEAD")[0] == 200
        assert server.get("/report.html", host=f"localhost:{server.port}")[0] == 200
        for path in ["/", "/?", "/checkpoint.pt", "/.hydra/config.yaml", "/.hydra/", "/metrics.jsonl",
                     "/replay/", "/replay/obs.npy", "/passwd", "/etc/passwd", "/etc/", "/../", "/..",
                     "/%2e%2e/", "/%2e%2e/etc/passwd", "/%2E%2E%2Fetc%2Fpasswd", "/./report.html/..",
                     "/report.html/", "/report.html%00", "//etc/passwd", "/nonexistent"]:
            status, body = server.get(path)
            assert status == 404, (path, status)
            assert b"root:" not in body and b"weights" not in body and b"secret" not in body
        for host in ["evil.example", f"evil.example:{server.port}", "127.0.0.1", f"127.0.0.1:{server.port + 1}",
                     f"127.0.0.1:{server.port}.evil.example", ""]:
            assert server.get("/report.html", host=host)[0] in (400, 403, 421), host
        assert server.get("/report.html", method="POST")[0] in (405, 501)
        # a link planted under the allowed name is not followed
        (root / "link").symlink_to("/etc/passwd")
        os.replace(root / "link", root / "report.html")
        status, body = server.get("/report.html")
        assert status == 404 and b"root:" not in body


def test_serve_closes_idle_and_slow_connections(tmp_path):
    root = _served_root(tmp_path / "run")
    with _Server(root, "--idle-timeout", "1") as server:
        idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        slow = None
        try:
            started = time.monotonic()
            assert idle.recv(100) == b"", "the server closed the silent connection"
            assert time.monotonic() - started < 1 + 2
            slow = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            slow.sendall(b"GET /report.html HTTP/1.1\r\n")
            started = time.monotonic()
            closed = False
            while time.monotonic() - started < 8:  # one header byte every 0.3 s: never idle for 1 s
                try:
                    slow.sendall(b"X")
                except OSError:
                    closed = True
                    break
                slow.settimeout(0.3)
                try:
                    if slow.recv(100) == b"":
                        closed = True
                        break
                except socket.timeout:
                    pass
            assert closed and time.monotonic() - started < 2 * 1 + 2, "the whole request head has a deadline"
            assert server.get("/report.html")[0] == 200, "and the server still answers"
        finally:
            idle.close()
            if slow is not None:
                slow.close()


# --------------------------------------------------------------------------------------------- odd files


def test_odd_files_under_the_root_are_named_in_the_page_not_a_hang_or_a_crash(tmp_path):
    root = tmp_path / "runs"
    rows = [_row(f) for f in (256, 512)]
    _fake_run(root / "good", ["seed=0"], rows, SUMMARY)
    fifo = root / "fifo"
    fifo.mkdir(parents=True)
    os.mkfifo(fifo / "metrics.jsonl")
    os.mkfifo(fifo / ".run.lock")
    deep = _fake_run(root / "deep", ["seed=1"], rows, SUMMARY)
    with open(deep / "metrics.jsonl", "a") as fh:
        fh.write("[" * 100_000 + "\n" + '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    long = _fake_run(root / "long", ["seed=2"], rows, SUMMARY)
    with open(long / "metrics.jsonl", "a") as fh:
        fh.write('{"frames": "' + "x" * 3_000_000 + '"}\n')
        fh.write('{"frames": 1' + "0" * 400 + ', "time": 1e999, "episode/return_mean": NaN}\n')
    lock = _fake_run(root / "lock", ["seed=3"], rows)
    (lock / ".run.lock").write_text("[]")
    nopid = _fake_run(root / "nopid", ["seed=4"], rows)
    (nopid / ".run.lock").write_text('{"pid": null}')
    yaml = _fake_run(root / "yaml", ["seed=5"], rows, SUMMARY)
    (yaml / ".hydra" / "overrides.yaml").write_text("- [unclosed\n")
    os.mkfifo(root / "good" / ".hydra" / "config.yaml")  # never read by the report: no hang either
    done = _report(root, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith(str(root / "report.html")), done.stderr[-2000:]
    page = (root / "report.html").read_text()
    problems = re.search(r'<section id="problems">(.*?)</section>', page, flags=re.S).group(1)
    for expected in [f"{fifo}/metrics.jsonl: a FIFO, skipped", f"{fifo}/.run.lock: a FIFO, skipped",
                     f"{deep}/metrics.jsonl: 2 damaged line(s) skipped (nested too deeply)",
                     f"{long}/metrics.jsonl: 1 damaged line(s) skipped (longer than 1 MB)",
                     f"{lock}/.run.lock: not a JSON object, ignored",
                     f"{yaml}/.hydra/overrides.yaml: not valid YAML, ignored"]:
        assert expected in problems, expected
    runs = {r.name: r for r in load_runs(root)}
    assert runs["fifo"].status == "unreadable"
    assert runs["deep"].status == "finished" and len(runs["deep"].rows) == 2
    assert runs["long"].status == "finished" and len(runs["long"].rows) == 3 and runs["long"].last("frames") == 512
    assert runs["lock"].status == runs["nopid"].status == "failed"
    assert runs["good"].problems == [] and runs["good"].status == "finished"


def test_a_file_that_cannot_be_read_is_listed_as_unreadable(tmp_path, monkeypatch):
    """Root reads anything, so the denial is simulated where files are opened; as a user, chmod 000 is real."""
    root = tmp_path / "runs"
    _fake_run(root / "good", ["seed=0"], [_row(256)], SUMMARY)
    denied = _fake_run(root / "denied", ["seed=1"], [_row(256)], SUMMARY) / "metrics.jsonl"
    if os.geteuid() != 0:
        denied.chmod(0)
        try:
            done = _report(root)
        finally:
            denied.chmod(stat.S_IRUSR | stat.S_IWUSR)
        assert done.returncode == 0, done.stderr
        assert f"{denied}: unreadable (Permission denied)" in (root / "report.html").read_text()

    def refuse(opener):
        def wrapped(path, *args, **kwargs):
            if not isinstance(path, int) and Path(os.fspath(path)) == denied:
                raise PermissionError(13, "Permission denied", str(path))
            return opener(path, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(os, "open", refuse(os.open))
    monkeypatch.setattr(io, "open", refuse(io.open))
    runs = {r.name: r for r in load_runs(root)}
    monkeypatch.undo()
    assert runs["denied"].status == "unreadable"
    assert runs["denied"].problems == ["metrics.jsonl: unreadable (Permission denied)"]
    assert runs["good"].status == "finished"
    page = build_page(list(runs.values()), "t")
    assert f"{denied}: unreadable (Permission denied)" in page


def test_report_html_is_written_atomically_and_private(tmp_path):
    root = tmp_path / "runs"
    _fake_run(root / "a", ["seed=0"], [_row(256)], SUMMARY)
    outside = tmp_path / "outside.html"
    outside.write_text("keep")
    (root / "report.html").symlink_to(outside)  # a link planted under the report's name is replaced, not followed
    done = _report(root)
    assert done.returncode == 0, done.stderr
    st = os.lstat(root / "report.html")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert outside.read_text() == "keep"
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_serve_sends_the_media_the_page_lists_and_only_as_regular_files(tmp_path):
    """What evaluation videos will use: listed media are served, through no link, and nothing unlisted."""
    import threading

    from pipeline.report.serve import ReportServer

    root = _served_root(tmp_path / "run")
    (root / "report.html").write_text("<!DOCTYPE html><p>page</p>")
    videos = root / "videos"
    videos.mkdir()
    (videos / "256.mp4").write_bytes(b"\0\0\0\x18ftypmp42")
    (videos / "512.mp4").symlink_to("/etc/passwd")
    (videos / "768.mp4").write_bytes(b"unlisted")
    (root / "lr=0.1,seed=1").mkdir()
    (root / "lr=0.1,seed=1" / "1 024.mp4").write_bytes(b"spaced")
    server = ReportServer(root, 0, "report.html", idle_timeout=2)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        server.allow(["videos/256.mp4", "videos/512.mp4", "lr=0.1,seed=1/1 024.mp4", "checkpoint.pt",
                      ".hydra/config.yaml", "../run/videos/256.mp4", "/etc/passwd.png", "videos/../checkpoint.pt"])
        status, body = _get(server.port, "/videos/256.mp4")
        assert status == 200 and body.startswith(b"\0\0\0\x18ftyp")
        assert _get(server.port, "/lr%3D0.1%2Cseed%3D1/1%20024.mp4") == (200, b"spaced")
        assert _get(server.port, "/lr=0.1,seed=1/1%20024.mp4") == (200, b"spaced"), "as a browser spells it"
        for path in ["/videos/512.mp4", "/videos/768.mp4", "/videos/", "/checkpoint.pt", "/.hydra/config.yaml",
                     "/../run/videos/256.mp4", "/etc/passwd.png", "/videos/../checkpoint.pt"]:
            assert _get(server.port, path)[0] == 404, path
        assert _get(server.port, "/report.html")[0] == 200
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_flock_lock_is_running_only_while_its_lock_is_held(tmp_path):
    """A lock of a flock claim stays after its run: its pid (maybe reused, here alive) decides nothing."""
    import fcntl

    root = tmp_path / "runs"
    lock = _fake_run(root / "a", ["seed=0"], [_row(256)]) / ".run.lock"
    lock.write_text(json.dumps({"v": 2, "pid": os.getpid(), "host": socket.gethostname(), "started": 1.0}))
    assert load_runs(root)[0].status == "failed", "the pid lives, but nobody holds the lock"
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert load_runs(root)[0].status == "running"
    finally:
        os.close(fd)
    assert load_runs(root)[0].status == "failed"
