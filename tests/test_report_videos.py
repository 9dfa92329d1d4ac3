"""The report's evaluation videos: listed from real files only, playable in a browser, served by --serve."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.report.page import render
from pipeline.report.runs import load_runs
from pipeline.report.videos import find_videos
from tests.conftest import ROOT, run_pipeline
from tests.test_report import CHROMIUM, _fake_run, _row


def test_only_regular_files_named_by_frames_in_a_real_videos_folder_are_listed(tmp_path):
    run = _fake_run(tmp_path / "runs" / "a", ["seed=0"], [_row(256), _row(512)])
    videos = run / "videos"
    videos.mkdir()
    for name in ("256.mp4", "1024.mp4", "512.mp4"):
        (videos / name).write_bytes(b"\0\0\0\x18ftypmp42")
    (videos / "notes.mp4").write_bytes(b"x")
    (videos / "2048.mp4").symlink_to("/etc/passwd")
    os.mkfifo(videos / "4096.mp4")
    assert find_videos(run, "a") == [(256, "a/videos/256.mp4"), (512, "a/videos/512.mp4"),
                                     (1024, "a/videos/1024.mp4")]
    other = _fake_run(tmp_path / "runs" / "b", ["seed=1"], [_row(256)])
    (other / "videos").symlink_to(videos)
    assert find_videos(other, "b") == [], "a videos folder that is a link is not followed"
    report = render(load_runs(tmp_path / "runs"), "t")
    assert report.media == ("a/videos/1024.mp4", "a/videos/512.mp4", "a/videos/256.mp4")
    assert report.html.count("<video ") == 3 and 'src="a/videos/1024.mp4"' in report.html


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_a_runs_videos_play_in_the_report_and_are_served(tmp_path):
    from PIL import Image

    root = tmp_path / "runs"
    run_dir = root / "cartpole"
    result = run_pipeline(["eval=video", "eval.interval=1024", "eval.episodes=1", "trainer.total_frames=3072",
                           "trainer.target_return=null", "logger=jsonl", "progress=false",
                           f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pipeline.report", str(root)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    page = root / "report.html"
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,1200",
            "--virtual-time-budget=15000", "--run-all-compositor-stages-before-draw"]
    dom = subprocess.run([*args, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert '<div id="js-errors"></div>' in dom, "no JavaScript error"
    section = dom.split('id="videos"', 1)[1].split("</section>", 1)[0]
    videos = re.findall(r"<video [^>]*>", section)
    latest = max(int(f.stem) for f in (run_dir / "videos").glob("*.mp4"))
    assert len(videos) == len(list((run_dir / "videos").glob("*.mp4"))) >= 2
    first = videos[0]
    assert f'src="cartpole/videos/{latest}.mp4"' in first and 'data-loaded="600x400"' in first, first
    assert all("data-loaded=" in v and "data-error" not in v for v in videos), "every video's media loaded"
    left, top, width, height = (int(n) for n in re.search(r'data-rect="([\d,]+)"', first).group(1).split(","))
    # headless Chromium's virtual time does not wait for the media decoder: on a loaded machine a screenshot can
    # come before the first frame is drawn (a black box with controls), so a few tries, each waiting longer
    for attempt in range(3):
        shot = tmp_path / f"shot{attempt}.png"
        subprocess.run([*args[:-2], f"--virtual-time-budget={15000 * (attempt + 1)}", args[-1],
                        f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=True)
        area = np.asarray(Image.open(shot).convert("RGB"))[top:top + height, left:left + width]
        white = float((area.min(axis=-1) > 200).mean()) if area.size else 0.0
        if white > 0.3:
            break
    assert area.size and area.std() > 20, "the video's area shows a frame, not a blank box"
    assert white > 0.3, f"CartPole's white background is drawn there ({white:.3f} white in {shot})"

    server = subprocess.Popen([sys.executable, "-m", "pipeline.report", str(root), "--serve", "--port", "0",
                               "--idle-timeout", "2"], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    try:
        line = server.stdout.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", line).group(1))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", f"/cartpole/videos/{latest}.mp4")
        response = conn.getresponse()
        body = response.read()
        assert response.status == 200 and body == (run_dir / "videos" / f"{latest}.mp4").read_bytes()
        assert response.getheader("Content-Type") == "video/mp4"
        conn.request("GET", "/cartpole/checkpoint.pt")
        response = conn.getresponse()
        response.read()
        assert response.status == 404
        conn.close()
    finally:
        os.killpg(server.pid, 2)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(5)
