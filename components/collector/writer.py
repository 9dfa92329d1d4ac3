"""The background replay writer: collection goes on while the trainer samples."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from components.collector.failures import CollectorError
from components.lifecycle import set_affinity


class ReplayWriter:
    """A thread that extends a replay buffer with every batch of an iterator.

    Each batch becomes ``postproc(batch)`` (e.g. n-step returns) in the
    buffer, then ``on_batch(batch)`` sees the raw batch (episode accounting
    and the trainer's backpressure: it may block). :attr:`lock` is held
    around each write, so whoever holds it (the collector's ``pause``) knows
    no write is under way. An error ends the thread and is raised by
    :meth:`check` in the consumer's thread.
    """

    def __init__(self, buffer: Any, postproc: Callable[[Any], Any] | None,
                 on_batch: Callable[[Any], None] | None, affinity: list[int] | None = None) -> None:
        self.buffer, self.postproc, self.on_batch = buffer, postproc, on_batch
        self.lock = threading.Lock()
        self._affinity = affinity
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closing = False

    def start(self, batches: Iterator[Any]) -> None:
        self._thread = threading.Thread(target=self._run, args=(batches,), name="replay-writer", daemon=True)
        self._thread.start()

    def _run(self, batches: Iterator[Any]) -> None:
        set_affinity(self._affinity)
        try:
            for batch in batches:
                with self.lock:
                    stored = batch if self.postproc is None else self.postproc(batch)
                    if stored.numel():
                        self.buffer.extend(stored)
                if self.on_batch is not None:
                    self.on_batch(batch)  # the batch is in replay now; may wait for the trainer
        except BaseException as exc:  # noqa: BLE001 - surfaced by check()
            if not self._closing:
                self._error = exc

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise the writer's error, if it stopped with one."""
        if self._error is not None:
            error = self._error
            if isinstance(error, CollectorError):
                raise CollectorError(str(error)) from error
            raise CollectorError(f"the replay writer failed: {error!r}") from error

    def stopping(self) -> None:
        """The collector is shutting down: an error from here on is the shutdown, not a failure."""
        self._closing = True

    def join(self, timeout: float) -> None:
        self._closing = True
        if self._thread is not None:
            self._thread.join(timeout)
