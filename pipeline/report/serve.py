"""``--serve``: an HTTP server on 127.0.0.1 that sends ``report.html`` and the media it references, nothing else.

The report's root is a tree of run directories: checkpoints (pickles of the
weights), configs, replay memmaps, and whatever else a run or another user
put there (a symlink to ``/etc``). A generic file server would hand all of it
to any process or web page that can reach the port. So this one:

- answers a path only when it is in an allow-list: ``/report.html`` and the
  media files the last built page references (:attr:`Report.media`); no
  listing, no index, no other file, whatever the path spells (``..``,
  ``%2e%2e``, ``//``, a query): everything else is 404;
- opens an allowed file one path component at a time with ``O_NOFOLLOW``
  from the root's directory fd (:func:`open_beneath`), and sends it only when
  it is a regular file: a symlink or FIFO planted under an allowed name is 404;
- answers only requests whose ``Host`` is ``127.0.0.1:<port>`` or
  ``localhost:<port>`` of the port it bound (403 otherwise): a web page the
  user opens can point a name it controls at 127.0.0.1 (DNS rebinding) and
  read the answers as same-origin, but its requests carry that name as Host;
- reads each request under a socket timeout and a deadline for the whole
  request head, and serves at most ``MAX_CLIENTS`` connections at once, so an
  idle or slowloris client holds a thread for seconds, not forever;
- knows GET and HEAD only (501 for the rest, from the base class).
"""

from __future__ import annotations

import mimetypes
import os
import socket
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

from pipeline.report.files import open_beneath

#: Seconds a connection may stay silent (and the whole request head may take, x2) before it is closed.
IDLE_TIMEOUT_S = 10.0
#: Connections served at once; more are closed at once (a local flood must not start unbounded threads).
MAX_CLIENTS = 32
_CHUNK = 1 << 16
#: What a media entry may be: a second fence should a page ever list a path from a run's own data.
MEDIA_SUFFIXES = (".mp4", ".webm", ".gif", ".png", ".jpg", ".jpeg", ".svg")


def media_allowed(relative: str) -> bool:
    """Whether ``relative`` may be served as media: a plain relative path to a media file, no dot-component."""
    parts = relative.split("/")
    return (relative.lower().endswith(MEDIA_SUFFIXES) and "\0" not in relative and "\\" not in relative
            and all(part and not part.startswith(".") for part in parts))


class ReportServer(ThreadingHTTPServer):
    """A threading server on 127.0.0.1 that knows the root and which of its files may be sent."""

    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, root: Path, port: int, page: str, *, idle_timeout: float = IDLE_TIMEOUT_S) -> None:
        self.root_fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        self.page = page
        self.idle_timeout = idle_timeout
        self._allowed: frozenset[str] = frozenset({page})
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        try:
            super().__init__(("127.0.0.1", port), ReportHandler)
        except BaseException:
            os.close(self.root_fd)
            raise
        self.port = self.server_address[1]
        self.hosts = {f"127.0.0.1:{self.port}", f"localhost:{self.port}"}
        if self.port == 80:
            self.hosts |= {"127.0.0.1", "localhost"}

    def allow(self, media: tuple[str, ...] | list[str]) -> None:
        """Set what may be served: the page and ``media`` (relative POSIX paths under the root).

        Entries that are not plain relative paths to media files (by suffix,
        without ``..`` or dot-directories such as ``.hydra``) are dropped.
        """
        with self._lock:
            self._allowed = frozenset({self.page, *(m for m in media if media_allowed(m))})

    def allowed(self, relative: str) -> bool:
        with self._lock:
            return relative in self._allowed

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: close, start no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that vanished mid-answer is no news; anything else is one line, and serving goes on."""
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            print(f"warning: serving a request failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)

    def server_close(self) -> None:
        super().server_close()
        try:
            os.close(self.root_fd)
        except OSError:
            pass


class ReportHandler(BaseHTTPRequestHandler):
    """GET/HEAD of allowed files only (see the module docstring)."""

    server: ReportServer
    server_version = "rlpipeline-report"
    protocol_version = "HTTP/1.0"  # one request per connection: nothing idles between requests

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout
        super().setup()
        # the socket timeout bounds each read; this bounds the whole request head (a client sending a
        # byte every few seconds would otherwise never time out)
        self._deadline = threading.Timer(2 * self.server.idle_timeout, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self) -> None:
        self._deadline.cancel()
        try:
            super().finish()
        except OSError:
            pass

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def do_HEAD(self) -> None:  # noqa: N802 - the base class's naming
        self._send(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._send(body=True)

    def _host_ok(self) -> bool:
        hosts = self.headers.get_all("Host") or []
        return len(hosts) == 1 and hosts[0].strip().lower() in self.server.hosts

    def _relative(self) -> str | None:
        """The requested file as a relative POSIX path, or None when the target is no plain path."""
        target = self.path
        if not target.startswith("/") or "#" in target:
            return None
        target = target.split("?", 1)[0]
        try:
            relative = unquote(target[1:], errors="strict")
        except UnicodeDecodeError:
            return None
        if not relative or "\0" in relative or "\\" in relative:
            return None
        return relative

    def _send(self, *, body: bool) -> None:
        self._deadline.cancel()  # the head is in; sending is bounded by the socket timeout per write
        if not self._host_ok():
            self.send_error(HTTPStatus.FORBIDDEN, "wrong Host (serving 127.0.0.1 only)")
            return
        relative = self._relative()
        if relative is None or not self.server.allowed(relative):
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        try:
            fd = open_beneath(self.server.root_fd, relative.split("/"))
        except OSError:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        with os.fdopen(fd, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            kind = mimetypes.guess_type(relative)[0] or "application/octet-stream"
            if kind.startswith("text/"):
                kind += "; charset=utf-8"
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(size))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Cross-Origin-Resource-Policy", "same-origin")
            self.send_header("X-Frame-Options", "DENY")
            self.end_headers()
            if not body:
                return
            left = size
            try:
                while left > 0:
                    chunk = fh.read(min(_CHUNK, left))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    left -= len(chunk)
            except OSError:  # the client went away or stopped reading for a whole timeout
                self.close_connection = True

