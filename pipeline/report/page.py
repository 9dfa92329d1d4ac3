"""The report page: a runs table and plotly panels in one self-contained HTML file.

plotly's JavaScript is inlined once (no CDN: the page opens offline), each
panel is a ``<section>`` with a stable id, and a panel whose keys no run
logged (a PPO run has no replay) is left out rather than drawn empty. A
small script records JavaScript errors into ``#js-errors`` and, once every
plot has drawn, sets ``data-rendered`` on ``<body>``: what a browser test
(and a curious user) can check.

Everything the page embeds comes from run directories, which anyone who can
write under the report's root (or who shared a run directory) controls: run
names, override keys and values, stop reasons, metric names. So nothing of it
is ever written as markup or code:

- text and attributes go through ``html.escape``;
- data for scripts sits in ``<script type="application/json">`` elements,
  encoded by :func:`~pipeline.report.escape.script_json`, which writes
  ``<``, ``>``, ``&`` and U+2028/2029 as ``\\u`` escapes: ``</script>`` or
  ``<!--`` cannot occur in it;
- the only executable scripts are this module's constants and plotly's own
  bundle, and the page's Content-Security-Policy names each by its hash, so a
  script smuggled in some other way would not run either;
- text that plotly draws (trace names, hover text, tick labels) is escaped
  with :func:`~pipeline.report.escape.plot_text`, since plotly reads
  ``<a href>``, ``<b>`` etc. in it;
- the JavaScript reads data with ``textContent``/``JSON.parse`` and writes
  it with ``textContent``, never ``innerHTML``.

:func:`render` also returns the relative paths of the media files the page
references (none yet; evaluation videos will be): exactly what ``--serve``
may send besides the page itself.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.report.escape import csp, escape_json_text, plot_text, script_json
from pipeline.report.runs import RunRecord, swept_keys
from pipeline.report.videos import STYLE as VIDEO_STYLE, VIDEO_JS, curve_figure, videos_section

_STATUS_COLOURS = {"running": "#1f77b4", "finished": "#2ca02c", "solved": "#17becf", "failed": "#d62728",
                   "interrupted": "#ff7f0e", "unreadable": "#7f7f7f"}
_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; }
th { background: #f3f3f3; cursor: pointer; user-select: none; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status { font-weight: 600; } .muted { color: #777; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 1em; }
#js-errors:empty { display: none; } #js-errors { color: #b00; white-space: pre; }
#problems li { font-family: ui-monospace, monospace; font-size: 0.85em; }
"""

_ERRORS_JS = """
window.__reportErrors = [];
window.addEventListener('error', function (e) {
  window.__reportErrors.push(String(e.message));
  var box = document.getElementById('js-errors');
  if (box) box.textContent = window.__reportErrors.join('\\n');
});
"""

_AFTER_JS = """
(function () {
  // draw each plot from its JSON element (data is never part of a script's code)
  document.querySelectorAll('script.plot-spec').forEach(function (spec) {
    var div = document.getElementById(spec.dataset.div), fig = JSON.parse(spec.textContent);
    if (div) Plotly.newPlot(div, fig.data, fig.layout, fig.config);
  });
  // sortable runs table: click a header
  var table = document.getElementById('runs-table');
  if (table) table.querySelectorAll('th').forEach(function (th, col) {
    th.addEventListener('click', function () {
      var body = table.tBodies[0], rows = Array.from(body.rows);
      var asc = th.dataset.order !== 'asc'; th.dataset.order = asc ? 'asc' : 'desc';
      rows.sort(function (a, b) {
        var x = a.cells[col].dataset.v || a.cells[col].textContent, y = b.cells[col].dataset.v || b.cells[col].textContent;
        var nx = parseFloat(x), ny = parseFloat(y);
        var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
        return asc ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
  // mark the page rendered once every plot has its SVG
  function check() {
    var plots = document.querySelectorAll('.js-plotly-plot');
    var drawn = document.querySelectorAll('.js-plotly-plot .main-svg');
    if (plots.length && drawn.length >= plots.length) {
      document.body.dataset.rendered = String(plots.length);
    } else { setTimeout(check, 50); }
  }
  check();
})();
"""


@dataclass(frozen=True)
class Report:
    """A built page and the media files (relative POSIX paths under the root) that it references."""

    html: str
    media: tuple[str, ...] = ()


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


class _Colours:
    """A colour per run, by the swept parameters' values when there is a sweep."""

    def __init__(self, runs: list[RunRecord], swept: list[str]) -> None:
        self.swept = swept
        labels = sorted({self.label(r) for r in runs}, key=_natural)
        self._by_label = {label: _PALETTE[i % len(_PALETTE)] for i, label in enumerate(labels)}

    def label(self, run: RunRecord) -> str:
        if not self.swept:
            return run.name
        return ", ".join(f"{k}={run.overrides.get(k, '(default)')}" for k in self.swept)

    def __call__(self, run: RunRecord) -> str:
        return self._by_label[self.label(run)]


def _natural(text: str) -> tuple:
    try:
        return (0, float(text.split("=")[-1]), text)
    except ValueError:
        return (1, 0.0, text)


def _line_figure(runs: list[RunRecord], colours: _Colours, key: str, x: str, title: str, xaxis: str,
                 yaxis: str) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    shown: set[str] = set()
    for run in runs:
        xs, ys = run.series(key, x)
        if not xs:
            continue
        label = colours.label(run)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines" if len(xs) > 20 else "lines+markers",
                                 name=plot_text(run.name if not colours.swept else label),
                                 legendgroup=plot_text(label), showlegend=label not in shown or not colours.swept,
                                 line={"color": colours(run)}, hovertext=plot_text(run.name)))
        shown.add(label)
    if not fig.data:
        return None
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis, height=380, margin={"t": 50, "b": 40})
    return fig


def _server_figure(runs: list[RunRecord], colours: _Colours) -> Any:
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    panels = [("server/requests_per_s", "requests/s"), ("server/avg_batch_size", "average batch (rows)"),
              ("server/queue_latency_p50_ms", "queue p50 (ms)"), ("server/queue_latency_p95_ms", "queue p95 (ms)"),
              ("server/forward_p50_ms", "forward p50 (ms)"), ("server/forward_p95_ms", "forward p95 (ms)"),
              ("server/policy_version", "policy version"), ("server/weight_updates", "weight updates / interval")]
    fig = make_subplots(rows=2, cols=4, subplot_titles=[t for _, t in panels])
    any_data = False
    for i, (key, _) in enumerate(panels):
        for run in runs:
            xs, ys = run.series(key, "time")
            if not xs:
                continue
            any_data = True
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=plot_text(colours.label(run)),
                                     showlegend=i == 0, legendgroup=plot_text(colours.label(run)),
                                     line={"color": colours(run)}),
                          row=i // 4 + 1, col=i % 4 + 1)
    if not any_data:
        return None
    fig.update_layout(title="Inference server (against wall time, s)", height=560, margin={"t": 80, "b": 40})
    return fig


def _workers_figure(runs: list[RunRecord]) -> Any:
    import plotly.graph_objects as go

    parts = [("collector/env_frac", "stepping envs"), ("collector/infer_wait_frac", "waiting for actions"),
             ("collector/chunk_wait_frac", "waiting for chunk space")]
    names, values = [], {k: [] for k, _ in parts}
    for run in runs:
        means = {}
        for key, _ in parts:
            _, ys = run.series(key, "frames")
            means[key] = sum(ys) / len(ys) if ys else None
        if all(v is None for v in means.values()):
            continue
        names.append(plot_text(run.name))
        for key in values:
            values[key].append(means[key] or 0.0)
    if not names:
        return None
    fig = go.Figure([go.Bar(name=label, x=names, y=values[key]) for key, label in parts])
    fig.update_layout(barmode="stack", title="Where worker time went (mean fraction of wall time)",
                      yaxis_title="fraction of wall time", height=380, margin={"t": 50, "b": 80})
    return fig


def _replay_figure(runs: list[RunRecord], colours: _Colours) -> Any:
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    keys = [("replay/size", "stored transitions"), ("replay/sampled", "samples drawn"),
            ("replay/rejected_stale", "rejected (stale)")]
    if not any(run.has("replay/") for run in runs):
        return None
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in keys])
    for i, (key, _) in enumerate(keys):
        for run in runs:
            xs, ys = run.series(key, "frames")
            if xs:
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=plot_text(colours.label(run)),
                                         showlegend=i == 0, legendgroup=plot_text(colours.label(run)),
                                         line={"color": colours(run)}),
                              row=1, col=i + 1)
    fig.update_layout(title="Replay (against frames)", height=360, margin={"t": 80, "b": 40})
    return fig


def _sweep_figure(runs: list[RunRecord], swept: list[str]) -> Any:
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    if not swept:
        return None
    fig = make_subplots(rows=2, cols=len(swept), row_titles=["final return", "frames/s"],
                        subplot_titles=[plot_text(k) for k in swept], vertical_spacing=0.15)
    for c, key in enumerate(swept, start=1):
        for r, value_of in enumerate((lambda run: run.final_return, lambda run: run.frames_per_s), start=1):
            points = [(run.overrides.get(key, "(default)"), value_of(run), run) for run in runs]
            points = [p for p in points if p[1] is not None]
            if not points:
                continue
            points.sort(key=lambda p: _natural(str(p[0])))
            fig.add_trace(go.Scatter(
                x=[plot_text(p[0]) for p in points], y=[p[1] for p in points], mode="markers", showlegend=False,
                marker={"size": 10, "color": [_STATUS_COLOURS.get(p[2].status, "#333") for p in points]},
                hovertext=[plot_text(f"{p[2].name} ({p[2].status})") for p in points]), row=r, col=c)
            fig.update_xaxes(type="category", row=r, col=c)
    if not fig.data:
        return None
    fig.update_layout(title="Sweep: each swept parameter against the final return and frames/s", height=560,
                      margin={"t": 80, "b": 40})
    return fig


def _runs_table(runs: list[RunRecord], swept: list[str]) -> str:
    columns: list[tuple[str, Callable[[RunRecord], Any], bool]] = [
        ("run", lambda r: r.name, False),
        ("status", lambda r: r.status, False),
        ("stop reason", lambda r: r.stop_reason, False),
        *[(key, lambda r, k=key: r.overrides.get(k, "(default)"), False) for key in swept],
        ("frames", lambda r: r.frames, True),
        ("wall time (s)", lambda r: r.wall_time_s, True),
        ("frames/s", lambda r: r.frames_per_s, True),
        ("final return", lambda r: r.final_return, True),
        ("overrides", lambda r: " ".join(f"{k}={v}" for k, v in r.overrides.items()), False),
    ]
    head = "".join(f"<th>{html.escape(name)}</th>" for name, _, _ in columns)
    body = []
    for run in runs:
        cells = []
        for name, get, numeric in columns:
            value = get(run)
            text = _fmt(value, 0 if name == "frames/s" else 1)
            attrs = f' class="num" data-v="{html.escape(str(value))}"' if numeric and value is not None else ""
            if name == "status":
                attrs = f' class="status" style="color:{_STATUS_COLOURS.get(run.status, "#333")}"'
            cells.append(f"<td{attrs}>{html.escape(text)}</td>")
        notes = []
        if run.skipped_lines:
            notes.append(f"({run.skipped_lines} unreadable line(s) skipped)")
        notes += [f"({problem})" for problem in run.problems if "damaged line" not in problem]
        if notes:
            cells[2] = cells[2].replace("</td>", "".join(f" <span class=muted>{html.escape(n)}</span>"
                                                         for n in notes) + "</td>")
        body.append(f'<tr data-status="{html.escape(run.status)}">{"".join(cells)}</tr>')
    return (f'<table id="runs-table"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def _problems_list(runs: list[RunRecord]) -> str:
    """A section naming every odd file (FIFO, unreadable, damaged lines), empty when there is none."""
    items = [f"<li>{html.escape(str(run.path / problem))}</li>" for run in runs for problem in run.problems]
    if not items:
        return ""
    return (f'<section id="problems"><h2>Files that could not be read</h2>'
            f"<ul>{''.join(items)}</ul></section>")


def _plot(fig: Any, div_id: str) -> str:
    """A plot's empty div and its figure as a JSON element (drawn by ``_AFTER_JS``)."""
    import plotly.io

    config = {"displaylogo": False, "responsive": True}
    figure = plotly.io.to_json(fig, validate=False)  # '{"data": ..., "layout": ...}'
    spec = '{"config":' + json.dumps(config) + "," + figure.lstrip()[1:]
    height = fig.layout.height or 450
    ident = html.escape(div_id)
    return (f'<div id="{ident}" class="plotly-graph-div" style="height:{int(height)}px; width:100%;"></div>'
            f'<script type="application/json" class="plot-spec" data-div="{ident}">{escape_json_text(spec)}</script>')


def build_page(runs: list[RunRecord], title: str, *, refresh_s: float | None = None) -> str:
    """The whole HTML document for ``runs``."""
    return render(runs, title, refresh_s=refresh_s).html


def render(runs: list[RunRecord], title: str, *, refresh_s: float | None = None) -> Report:
    """The page for ``runs`` and the media files it references (see :class:`Report`)."""
    import plotly.offline

    swept = swept_keys(runs) if len(runs) > 1 else []
    colours = _Colours(runs, swept)
    panels: list[tuple[str, str, Any]] = [
        ("return-vs-frames", "Episode return against frames",
         _line_figure(runs, colours, "episode/return_mean", "frames", "Mean episode return", "frames", "return")),
        ("return-vs-time", "Episode return against wall time",
         _line_figure(runs, colours, "episode/return_mean", "time", "Mean episode return", "wall time (s)",
                      "return")),
        ("frames-per-s", "Collector throughput",
         _line_figure(runs, colours, "collector/frames_per_s", "time", "Collector frames/s", "wall time (s)",
                      "frames/s")),
        ("server", "Inference server", _server_figure(runs, colours)),
        ("workers", "Env workers", _workers_figure(runs)),
        ("replay", "Replay", _replay_figure(runs, colours)),
        ("sweep", "Sweep", _sweep_figure(runs, swept)),
    ]
    sections = []
    for div_id, heading, fig in panels:
        if fig is None:
            continue
        plot = _plot(fig, f"plot-{div_id}")
        sections.append(f'<section class="panel" id="{div_id}"><h2>{html.escape(heading)}</h2>{plot}</section>')
    counts = {s: sum(r.status == s for r in runs) for s in _STATUS_COLOURS}
    status_line = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    refresh = f'<meta http-equiv="refresh" content="{float(refresh_s):g}">' if refresh_s else ""
    videos, listed = videos_section(runs, colours.label,
                                    lambda run: _plot(curve_figure(run, colours(run)), f"curve-{runs.index(run)}"))
    media = tuple(listed)
    meta = script_json({"runs": len(runs), "panels": [p[0] for p in panels if p[2] is not None], "swept": swept,
                        "media": list(media)})
    plotly_js = plotly.offline.get_plotlyjs().replace("\r\n", "\n").replace("\r", "\n")
    if "</script" in plotly_js.lower():
        raise RuntimeError("this plotly bundle cannot be inlined (it holds '</script')")
    policy = csp([_ERRORS_JS, plotly_js, _AFTER_JS, VIDEO_JS])
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{refresh}
<meta http-equiv="Content-Security-Policy" content="{html.escape(policy)}">
<meta name="referrer" content="no-referrer">
<title>{html.escape(title)}</title>
<style>{_STYLE}{VIDEO_STYLE}</style>
<script>{_ERRORS_JS}</script>
<script>{plotly_js}</script>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p class="muted">{len(runs)} run(s): {html.escape(status_line) or "none"}. Built {time.strftime("%Y-%m-%d %H:%M:%S")}.
Click a column header to sort.</p>
<div id="js-errors"></div>
<script type="application/json" id="report-meta">{meta}</script>
<section id="runs"><h2>Runs</h2>{_runs_table(runs, swept)}</section>
{_problems_list(runs)}
{videos}
<div class="panels">{''.join(sections)}</div>
<script>{_AFTER_JS}</script>
<script>{VIDEO_JS}</script>
</body></html>
"""
    return Report(page, media)
