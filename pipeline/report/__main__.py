"""``python -m pipeline.report [PATH] [--serve] [--port N] [--idle-timeout S]``: build (and serve) ``PATH/report.html``.

PATH is a run directory, a multirun (sweep) directory or any parent of runs
(default ``runs/``). Nothing under PATH changes except ``report.html``,
written atomically. With ``--serve`` the page is served on 127.0.0.1 and
rebuilt every ``--every`` seconds while runs are still writing (the page
reloads itself meanwhile); Ctrl-C stops the server. The server sends the
page and the media files it references, nothing else (see
:mod:`pipeline.report.serve`).

Whatever the runs' files hold, the command ends with a page (odd files named
in it) or with one line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from components.atomic_files import write_atomic
from pipeline.report.page import render
from pipeline.report.runs import find_run_dirs, load_runs

REPORT = "report.html"
#: The page holds what the runs' own files hold (paths, overrides, metrics), which runs write 0600:
#: the report is the user's too. ``chmod`` it (or copy it) to share it.
REPORT_MODE = 0o600


def write_report(root: Path, *, refresh_s: float | None = None) -> tuple[Path, int, tuple[str, ...]]:
    """Build ``root/report.html``; returns its path, the number of runs and the media files it references."""
    runs = load_runs(root)
    report = render(runs, f"rlpipeline report: {root.resolve().name or root}", refresh_s=refresh_s)
    out = write_atomic(root / REPORT, report.html, mode=REPORT_MODE)
    return out, len(runs), report.media


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM end the server cleanly, even when this process was started with them ignored.

    A shell starts background jobs (``cmd &``, ``nohup``) with SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler: such a
    server could only be killed. Found when a test's SIGINT was ignored.
    """
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, interrupt)


def serve(root: Path, port: int, every: float, idle_timeout: float) -> None:
    from pipeline.report.serve import ReportServer

    _stop_on_signals()
    out, count, media = write_report(root, refresh_s=every)
    server = ReportServer(root, port, REPORT, idle_timeout=idle_timeout)
    server.allow(media)
    stop = threading.Event()

    def rebuild() -> None:
        while not stop.wait(every):
            try:
                server.allow(write_report(root, refresh_s=every)[2])
            except Exception as err:  # noqa: BLE001 - keep serving the last good page
                print(f"warning: could not rebuild the report: {err}", file=sys.stderr, flush=True)

    rebuilder = threading.Thread(target=rebuild, name="report-rebuild", daemon=True)
    rebuilder.start()
    host, real_port = server.server_address[:2]
    try:  # before the line: a Ctrl-C right after it (a reader acting on it) must find the handler's frame
        print(f"serving {out} ({count} runs) at http://{host}:{real_port}/{REPORT} "
              f"(rebuilt every {every:g} s; Ctrl-C stops)", flush=True)
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        server.server_close()
        rebuilder.join(30)  # a rebuild in progress finishes its write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="runs", help="a run, a sweep, or a parent of runs (default: runs)")
    parser.add_argument("--serve", action="store_true", help="serve the report on 127.0.0.1 and keep it current")
    parser.add_argument("--port", type=int, default=8000, help="port for --serve (0: any free one)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between rebuilds with --serve")
    parser.add_argument("--idle-timeout", type=float, default=10.0,
                        help="seconds --serve waits for a silent connection before closing it")
    args = parser.parse_args(argv)
    root = Path(args.path)
    if not 0 <= args.port <= 65535:
        print(f"error: --port must be 0-65535, not {args.port}", file=sys.stderr)
        return 2
    if not 0 < args.idle_timeout <= 3600:
        print("error: --idle-timeout must be > 0 and <= 3600 seconds", file=sys.stderr)
        return 2
    if not root.is_dir():
        print(f"error: {root}: not a directory", file=sys.stderr)
        return 2
    if not os.access(root, os.W_OK):
        print(f"error: {root}: cannot write {REPORT} there", file=sys.stderr)
        return 2
    if not 0 < args.every <= 86400:
        print("error: --every must be > 0 and <= 86400 seconds", file=sys.stderr)
        return 2
    if args.serve:
        try:
            serve(root, args.port, args.every, args.idle_timeout)
        except OSError as err:
            print(f"error: cannot serve {root} on 127.0.0.1:{args.port}: {err.strerror or err}", file=sys.stderr)
            return 2
        return 0
    if not find_run_dirs(root):
        print(f"error: {root}: no runs there (no metrics.jsonl below it)", file=sys.stderr)
        return 1
    started = time.monotonic()
    try:
        out, count, _ = write_report(root)
    except OSError as err:
        print(f"error: cannot write {root / REPORT}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"{out} ({count} runs, {time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
