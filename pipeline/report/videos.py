"""The report's evaluation videos: which files a run has, and the panel that plays them beside its curve.

The page refers to each run's ``videos/<frames>.mp4`` by a relative URL and
does not embed them: an mp4 is hundreds of KB to MBs, a run has ten or more,
and base64 inside the page would make it a third larger again and load every
video to show one. The page stays one small file that plays the videos when
opened from disk next to the runs (``file://``: relative URLs resolve) and
through ``--serve``, which sends exactly the media files the page lists
(:attr:`pipeline.report.page.Report.media`) and nothing else.

A run directory may hold anything (a symlink named ``videos``, a FIFO named
``1.mp4``), so only regular files named ``<digits>.mp4`` in a real
``videos`` directory are listed, read with ``lstat`` (no link is followed).
"""

from __future__ import annotations

import html
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.report.escape import media_url

#: a video the evaluator writes: ``<frames>.mp4``
_NAME = re.compile(r"^(\d{1,15})\.mp4$")
#: runs whose videos the page shows (the ones with the newest videos), and earlier videos per run in its strip
MAX_RUNS, MAX_STRIP = 24, 8

STYLE = """
.video-run { border-top: 1px solid #ddd; padding-top: 0.6em; margin-top: 0.6em; }
.video-run h3 { font-size: 0.95em; margin: 0.2em 0; font-family: ui-monospace, monospace; }
.video-row { display: grid; grid-template-columns: minmax(360px, 1fr) minmax(240px, 420px); gap: 1em; align-items: start; }
.video-latest video { width: 100%; background: #000; }
.video-strip { display: flex; gap: 0.5em; overflow-x: auto; }
.video-strip video { width: 160px; background: #000; }
figure { margin: 0; } figcaption { font-size: 0.8em; color: #555; }
"""

#: each video says when its media loaded (``data-loaded``: its size; ``data-rect``: where it sits on the page)
#: or failed (``data-error``): what a user's browser shows, made checkable by a headless one
VIDEO_JS = """
document.querySelectorAll('video').forEach(function (v) {
  function loaded() {
    var r = v.getBoundingClientRect();
    v.dataset.loaded = v.videoWidth + 'x' + v.videoHeight;
    v.dataset.rect = [r.left, r.top + window.scrollY, r.width, r.height].map(Math.round).join(',');
  }
  if (v.readyState >= 1) loaded(); else v.addEventListener('loadedmetadata', loaded);
  v.addEventListener('error', function () { v.dataset.error = String(v.error && v.error.code); });
});
"""


def find_videos(run_dir: Path, relative_dir: str) -> list[tuple[int, str]]:
    """``(frames, path relative to the report's root)`` of each evaluation video of the run, by frames."""
    folder = run_dir / "videos"
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return []
        entries = list(os.scandir(folder))
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _NAME.match(entry.name)
        try:
            if match and entry.is_file(follow_symlinks=False):
                prefix = f"{relative_dir}/" if relative_dir else ""
                found.append((int(match.group(1)), f"{prefix}videos/{entry.name}"))
        except OSError:
            continue
    return sorted(found)


def _video(path: str, frames: int, caption: str, strip: bool) -> str:
    loop = "" if strip else " loop"
    return (f'<figure><video controls muted playsinline{loop} preload="metadata" '
            f'src="{html.escape(media_url(path))}" data-frames="{int(frames)}"></video>'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def videos_section(runs: list[Any], label: Callable[[Any], str], curve: Callable[[Any], str]) -> tuple[str, list[str]]:
    """The panel (empty without videos) and the media paths it references.

    ``label(run)`` names a run, ``curve(run)`` is the HTML of its return curve (drawn by the page's plotly).
    """
    with_videos = [r for r in runs if getattr(r, "videos", None)]
    with_videos.sort(key=lambda r: r.videos[-1][0], reverse=True)
    shown = with_videos[:MAX_RUNS]
    if not shown:
        return "", []
    media: list[str] = []
    blocks = []
    for run in shown:
        latest_frames, latest = run.videos[-1]
        earlier = run.videos[-1 - MAX_STRIP:-1]
        media += [latest, *(p for _, p in reversed(earlier))]
        strip = "".join(_video(p, f, f"{f:,} frames", strip=True) for f, p in reversed(earlier))
        blocks.append(
            f'<div class="video-run" data-run="{html.escape(run.name)}"><h3>{html.escape(label(run))}</h3>'
            f'<div class="video-row"><div class="video-curve">{curve(run)}</div>'
            f'<div class="video-latest">{_video(latest, latest_frames, f"latest: {latest_frames:,} frames", False)}'
            f'</div></div>'
            + (f'<div class="video-strip">{strip}</div>' if strip else "") + "</div>")
    more = len(with_videos) - len(shown)
    note = f'<p class="muted">{more} more run(s) with videos not shown.</p>' if more > 0 else ""
    return ('<section class="panel" id="videos"><h2>Evaluation videos</h2>'
            '<p class="muted">Each run\'s latest evaluation video beside its return curve (dotted lines: the frames '
            'of its videos), earlier ones below.</p>' + "".join(blocks) + note + "</section>"), media


def curve_figure(run: Any, colour: str) -> Any:
    """A small figure of the run's training and evaluation return, a dotted line at each video's frames."""
    import plotly.graph_objects as go

    from pipeline.report.escape import plot_text

    fig = go.Figure()
    # an evaluation at the frames it evaluated (eval/frames), not those of the row it came back in
    for key, x, name, dash in (("episode/return_mean", "frames", "train return", "solid"),
                               ("eval/return_mean", "eval/frames", "eval return", "dot")):
        xs, ys = run.series(key, x)
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers" if len(xs) < 20 else "lines",
                                     name=plot_text(name), line={"color": colour, "dash": dash}))
    for frames, _ in run.videos:
        fig.add_vline(x=frames, line={"color": "#999", "dash": "dot", "width": 1})
    fig.update_layout(height=260, margin={"t": 20, "b": 35, "l": 45, "r": 10}, xaxis_title="frames",
                      yaxis_title="return", legend={"orientation": "h", "y": 1.12})
    return fig
