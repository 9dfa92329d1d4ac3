"""In-process transport: a queue of requests, each answered through a future.

The natural transport when env workers are threads of the driver: no copies
beyond one ``torch.cat`` per input key per batch, any number of clients, and
several requests in flight per client.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from components.inference.stats import now
from components.inference.transport import (
    InferenceTransport,
    Layout,
    Pending,
    RemotePolicyError,
    ServerStoppedError,
)


class _Request:
    __slots__ = ("inputs", "modes", "rows", "future", "submitted_at")

    def __init__(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor, rows: int) -> None:
        self.inputs = inputs
        self.modes = modes
        self.rows = rows
        self.future: Future = Future()
        self.submitted_at = now()


class ThreadTransport(InferenceTransport):
    """Queue transport for clients and a server living in one process.

    Examples:
        >>> import torch
        >>> t = ThreadTransport()
        >>> fut = t.client().submit({"observation": torch.zeros(2, 4)}, mode=0)
        >>> [p.rows for p in t.drain(max_rows=8)]
        [2]
    """

    def __init__(self, layout: Layout | None = None) -> None:
        self.layout = layout  # type: ignore[assignment]
        self._queue: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._head: _Request | None = None
        self._closed = False
        self._close_lock = threading.Lock()

    def client(self) -> ThreadClient:
        return ThreadClient(self)

    def submit(self, inputs: dict[str, torch.Tensor], mode: int | torch.Tensor) -> Future:
        if self._closed:
            raise ServerStoppedError("the inference server has been shut down")
        inputs = {k: torch.as_tensor(v) for k, v in inputs.items()}
        rows = next(iter(inputs.values())).shape[0]
        for key, value in inputs.items():
            if value.shape[0] != rows:
                raise ValueError(f"request input {key!r} has {value.shape[0]} rows, expected {rows}")
        if not isinstance(mode, int):
            modes = torch.as_tensor(mode).to(torch.int8).expand(rows)
        else:
            modes = torch.full((rows,), int(mode), dtype=torch.int8)
        request = _Request(inputs, modes, rows)
        self._queue.put(request)
        if self._closed:  # raced with close(): make sure nobody waits forever
            self._fail_queued()
        return request.future

    def wait_for_work(self, timeout: float) -> bool:
        if self._head is not None:
            return True
        try:
            self._head = self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        return True

    def drain(self, max_rows: int) -> list[Pending]:
        taken: list[Pending] = []
        rows = 0
        while True:
            request = self._head
            if request is None:
                try:
                    request = self._queue.get_nowait()
                except queue.Empty:
                    break
            if taken and rows + request.rows > max_rows:
                self._head = request
                break
            self._head = None
            if not request.future.set_running_or_notify_cancel():
                continue  # the client cancelled it
            taken.append(Pending(request, request.rows, request.submitted_at))
            rows += request.rows
            if rows >= max_rows:
                break
        return taken

    def gather(self, requests: Sequence[Pending]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        reqs = [p.handle for p in requests]
        if len(reqs) == 1:
            return reqs[0].inputs, reqs[0].modes
        keys = reqs[0].inputs.keys()
        inputs = {key: torch.cat([r.inputs[key] for r in reqs]) for key in keys}
        return inputs, torch.cat([r.modes for r in reqs])

    def resolve(self, requests: Sequence[Pending], outputs: dict[str, Any]) -> None:
        outputs = {k: torch.as_tensor(v) for k, v in outputs.items()}  # engines may answer in numpy
        start = 0
        for pending in requests:
            stop = start + pending.rows
            pending.handle.future.set_result({k: v[start:stop] for k, v in outputs.items()})
            start = stop

    def resolve_exception(self, requests: Sequence[Pending], exc: BaseException) -> None:
        for pending in requests:
            error = RemotePolicyError(f"the served policy raised {exc!r}")
            error.__cause__ = exc
            pending.handle.future.set_exception(error)

    def close(self) -> None:
        with self._close_lock:
            self._closed = True
        self._fail_queued()

    def _fail_queued(self) -> None:
        pending = [self._head] if self._head is not None else []
        self._head = None
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for request in pending:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(ServerStoppedError("the inference server was shut down"))


class ThreadClient:
    """Requester handle of a :class:`ThreadTransport`; cheap, one per worker."""

    def __init__(self, transport: ThreadTransport) -> None:
        self._transport = transport

    def submit(self, inputs: dict[str, Any], mode: int | Any = 0) -> Future:
        return self._transport.submit(inputs, mode)
