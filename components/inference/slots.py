"""Fixed shared-memory slots: worker processes reach an inference server directly.

Every client owns one slot (a block of rows) in a request bank and a
response bank allocated once from the transport's :class:`Layout`. A client
copies its observation block into its slot, flags it ready and rings the
doorbell semaphore; the server sweeps ready slots round-robin, gathers them
with one gather per input field, and scatters the responses with one copy per
output field before waking each owner through its own semaphore. Only those
signals cross processes on the hot path.

It is the one request/response path of every placement: ``ctx`` supplies
the semaphores and the lock, the ``threading`` module when workers and
server are threads of one process, a ``spawn`` multiprocessing context when
either side is a process (as :class:`~components.collector.chunks.ChunkPool`
takes it). The banks are shared memory either way.

Liveness: the server side holds the write end of a pipe nobody writes to.
When the server goes away, however it dies (a process killed, a server
thread ended by an error), that end is closed and a waiting client sees
end-of-file on its next check (every 0.1 s), so it fails with
:class:`ServerDiedError` instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence
from typing import Any

import numpy as np

from components.action_noise import NOISE_KEY, fresh_uniforms
from components.inference.stats import now
from components.lifecycle import take_shared_lock
from components.inference.transport import (
    InferenceTransport,
    Layout,
    Pending,
    RemotePolicyError,
    ServerDiedError,
)
from components.shm import FieldSpec, SharedArena

_PEER_CHECK_S = 0.1
_ABANDONED_LOCK_S = 1.0
_ERROR_BYTES = 2048
_OK, _FAILED = 0, 1


def _req(name: str) -> str:
    return "req." + name


def _resp(name: str) -> str:
    return "resp." + name


def _arena_fields(layout: Layout, slots: int, rows: int) -> list[FieldSpec]:
    fields = [FieldSpec(_req(f.name), f.shape, f.dtype).with_leading(slots, rows) for f in layout.request]
    fields.append(FieldSpec("req.mode", (slots, rows), "int8"))
    fields += [FieldSpec(_resp(f.name), f.shape, f.dtype).with_leading(slots, rows) for f in layout.response]
    fields += [
        FieldSpec("ctl.ready", (slots,), "int8"),
        FieldSpec("ctl.rows", (slots,), "int32"),
        FieldSpec("ctl.submitted_at", (slots,), "float64"),
        FieldSpec("ctl.status", (slots,), "int8"),
        FieldSpec("ctl.error", (slots, _ERROR_BYTES), "uint8"),
        # Request numbers: the client numbers each request, the server echoes the number it
        # drained, and a client accepts only the answer to its own latest request. That keeps
        # a restarted worker from taking the late answer to its dead predecessor's request.
        FieldSpec("ctl.req_seq", (slots,), "int64"),
        FieldSpec("ctl.resp_seq", (slots,), "int64"),
    ]
    return fields


class SlotTransport(InferenceTransport):
    """``num_slots`` fixed request/response slots of ``rows_per_slot`` rows each.

    Create it in the driver before spawning anything, hand one
    :meth:`client` to each worker process (as a ``Process`` argument), and
    serve it from an :class:`~components.inference.server.InferenceServer`
    in a thread or a dedicated process. With ``ctx=threading`` (everything
    in one process) nothing is pickled; clients are used by threads.

    Examples:
        >>> from components.shm import FieldSpec
        >>> layout = Layout((FieldSpec("observation", (4,), "float32"),),
        ...                 (FieldSpec("action", (), "int64"), FieldSpec("policy_version", (), "int64")))
        >>> transport = SlotTransport(layout, num_slots=2, rows_per_slot=3)
        >>> client = transport.client()
        >>> client.request["observation"][:] = 1.0
        >>> client.submit()
        >>> [(p.handle, p.rows) for p in transport.drain(max_rows=8)]
        [(0, 3)]
    """

    def __init__(
        self,
        layout: Layout,
        *,
        num_slots: int,
        rows_per_slot: int,
        ctx: Any = None,
    ) -> None:
        if num_slots < 1 or rows_per_slot < 1:
            raise ValueError(f"num_slots and rows_per_slot must be >= 1, got {num_slots}, {rows_per_slot}")
        self.layout = layout
        self.num_slots = num_slots
        self.rows_per_slot = rows_per_slot
        ctx = ctx or mp.get_context("spawn")
        self._arena = SharedArena(_arena_fields(layout, num_slots, rows_per_slot))
        self._doorbell = ctx.Semaphore(0)
        self._lock = ctx.Lock()
        self._wakeups = [ctx.Semaphore(0) for _ in range(num_slots)]
        # An OS pipe works between threads and between processes alike.
        self._alive_reader, self._alive_writer = mp.Pipe(duplex=False)
        self._next_client = 0
        self._next_slot = 0
        self._server_views: dict[str, Any] | None = None
        self._drained_seq = np.zeros(num_slots, np.int64)

    # ----------------------------------------------------------- client side
    def client(self, slot: int | None = None) -> SlotClient:
        """The client of the next free slot, or a fresh one for ``slot`` (a restarted worker's)."""
        if slot is None:
            slot = self._next_client
            if slot >= self.num_slots:
                raise RuntimeError(f"all {self.num_slots} slots already have a client")
            self._next_client += 1
        elif not 0 <= slot < self._next_client:
            raise ValueError(f"slot {slot} has no client yet")
        return SlotClient(self._arena, slot, self._doorbell, self._lock, self._wakeups[slot], self._alive_reader, self.layout)

    def release_liveness_handle(self) -> None:
        """Drop this process's write end of the liveness pipe.

        Call it in the driver once a server *process* holds its own copy;
        from then on the pipe closes exactly when that server exits. A server
        thread calls it when it ends, for whatever reason.
        """
        if self._alive_writer is not None:
            self._alive_writer.close()
            self._alive_writer = None

    def __getstate__(self) -> dict[str, Any]:
        if self._alive_writer is None:
            raise RuntimeError("this transport's server side was already handed over")
        state = dict(self.__dict__)
        state["_server_views"] = None
        return state

    # ----------------------------------------------------------- server side
    # Numpy throughout: a few microseconds per call matter at thousands of
    # batches per second, and numpy indexing costs a fraction of torch's.
    def _views(self) -> dict[str, Any]:
        if self._server_views is None:
            a = self._arena
            self._server_views = {
                "req": {f.name: a.array(_req(f.name)) for f in self.layout.request},
                "mode": a.array("req.mode"),
                "resp": {f.name: a.array(_resp(f.name)) for f in self.layout.response},
            }
        return self._server_views

    def pending(self) -> int:
        """Requests submitted and not answered yet, whoever reads it (the driver's hang watchdog)."""
        a = self._arena
        return int(np.count_nonzero(a.array("ctl.req_seq") != a.array("ctl.resp_seq")))

    def wait_for_work(self, timeout: float) -> bool:
        if self._doorbell.acquire(timeout=max(timeout, 0.0)):
            return True
        return bool(self._arena.array("ctl.ready").any())

    def drain(self, max_rows: int) -> list[Pending]:
        flags = self._arena.array("ctl.ready")
        # Pairs with the client's lock (publishes its slot writes); a worker
        # process killed inside submit would otherwise hang the server here.
        take_shared_lock(self._lock, _ABANDONED_LOCK_S)
        try:
            ready = np.flatnonzero(flags)
            if ready.size == 0:
                return []
            # Round-robin: start after the last slot served, so a busy
            # low-numbered worker cannot starve the others.
            first = int(np.searchsorted(ready, self._next_slot))
            if first:
                ready = np.concatenate((ready[first:], ready[:first]))
            rows = self._arena.array("ctl.rows")[ready]
            count = ready.size
            if int(rows.sum()) > max_rows:  # whole requests up to max_rows, at least one
                count = max(1, int(np.searchsorted(np.cumsum(rows), max_rows, side="right")))
            chosen = ready[:count]
            flags[chosen] = 0
            stamps = self._arena.array("ctl.submitted_at")[chosen]
            self._drained_seq[chosen] = self._arena.array("ctl.req_seq")[chosen]
        finally:
            self._lock.release()
        slots = chosen.tolist()
        self._next_slot = (slots[-1] + 1) % self.num_slots
        # Doorbells of requests swept together with another one are stale
        # now; consume them so the next wait does not spin on them.
        for _ in range(count - 1):
            self._doorbell.acquire(False)  # positional: threading and mp spell the keyword differently
        return [Pending(s, r, t) for s, r, t in zip(slots, rows[:count].tolist(), stamps.tolist())]

    @staticmethod
    def _index(requests: Sequence[Pending]) -> slice | np.ndarray:
        slots = sorted(p.handle for p in requests)
        if slots[-1] - slots[0] + 1 == len(slots):
            return slice(slots[0], slots[-1] + 1)
        return np.asarray(slots)

    def gather(self, requests: Sequence[Pending]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Numpy views of the slots (contiguous slots: no copy), else one gather per field."""
        views = self._views()
        index = self._index(requests)
        flat = len(requests) * self.rows_per_slot
        inputs = {name: bank[index].reshape(flat, *bank.shape[2:]) for name, bank in views["req"].items()}
        return inputs, views["mode"][index].reshape(flat)

    def resolve(self, requests: Sequence[Pending], outputs: dict[str, Any]) -> None:
        views = self._views()
        index = self._index(requests)
        k = len(requests)
        for name, bank in views["resp"].items():
            value = outputs[name]
            value = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            bank[index] = value.reshape(k, self.rows_per_slot, *bank.shape[2:])
        self._arena.array("ctl.status")[index] = _OK
        self._arena.array("ctl.resp_seq")[index] = self._drained_seq[index]
        for pending in requests:
            self._wakeups[pending.handle].release()

    def resolve_exception(self, requests: Sequence[Pending], exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[: _ERROR_BYTES - 1]
        errors = self._arena.array("ctl.error")
        status = self._arena.array("ctl.status")
        resp_seq = self._arena.array("ctl.resp_seq")
        for pending in requests:
            resp_seq[pending.handle] = self._drained_seq[pending.handle]
            errors[pending.handle, :] = 0
            errors[pending.handle, : len(message)] = np.frombuffer(message, np.uint8)
            status[pending.handle] = _FAILED
            self._wakeups[pending.handle].release()


class SlotClient:
    """One worker's slot: write :attr:`request`, :meth:`submit`, :meth:`wait`.

    Picklable as a ``Process`` argument; the arrays it exposes are views of
    the shared banks, so nothing is copied or pickled per request.
    """

    def __init__(
        self,
        arena: SharedArena,
        slot: int,
        doorbell: Any,
        lock: Any,
        wakeup: Any,
        alive: Any,
        layout: Layout,
    ) -> None:
        self._arena, self.slot = arena, slot
        self._doorbell, self._lock, self._wakeup, self._alive = doorbell, lock, wakeup, alive
        self.layout = layout
        self._bind()

    def _bind(self) -> None:
        a, s = self._arena, self.slot
        self.request = {f.name: a.array(_req(f.name))[s] for f in self.layout.request}
        self.modes = a.array("req.mode")[s]
        self.response = {f.name: a.array(_resp(f.name))[s] for f in self.layout.response}
        self.capacity = self.modes.shape[0]
        self._ready = a.array("ctl.ready")
        self._rows = a.array("ctl.rows")
        self._submitted = a.array("ctl.submitted_at")
        self._status = a.array("ctl.status")
        self._req_seq, self._resp_seq = a.array("ctl.req_seq"), a.array("ctl.resp_seq")
        self._in_flight = False
        self._checked = float("-inf")
        self._rng: np.random.Generator | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("_arena", "slot", "_doorbell", "_lock", "_wakeup", "_alive", "layout")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def server_alive(self) -> bool:
        return not self._alive.poll()

    def submit(self, rows: int | None = None, mode: int | None = None) -> None:
        """Publish the slot's request (its first ``rows`` rows) to the server."""
        if self._in_flight:
            raise RuntimeError("this slot already has a request in flight; wait() for it first")
        rows = self.capacity if rows is None else rows
        if not 1 <= rows <= self.capacity:
            raise ValueError(f"a request of {rows} rows does not fit this slot ({self.capacity} rows)")
        stamp = now()
        if stamp - self._checked > _PEER_CHECK_S:  # a syscall: not on every request
            self._checked = stamp
            if self._alive.poll():
                raise ServerDiedError(f"the inference server exited before slot {self.slot} submitted")
        if mode is not None:
            self.modes[:] = mode
        self._rows[self.slot] = rows
        self._submitted[self.slot] = stamp
        self._req_seq[self.slot] += 1
        # The server takes this lock too: SIGKILLed while holding it, it would
        # hold it forever, so wait in steps and give up once the server is gone
        # (a worker thread blocked here could never be stopped or replaced).
        while not self._lock.acquire(True, _PEER_CHECK_S):  # positional: threading and mp spell it differently
            if self._alive.poll():
                raise ServerDiedError(f"the inference server exited while slot {self.slot} submitted")
        try:
            self._ready[self.slot] = 1
        finally:
            self._lock.release()
        self._in_flight = True
        self._doorbell.release()

    def submit_inputs(self, inputs: dict[str, Any], mode: int | Any = 0) -> SlotFuture:
        """Copy tensors (or arrays) into the slot and submit; returns a future."""
        rows = None
        for name, target in self.request.items():
            if name == NOISE_KEY and name not in inputs:
                continue  # filled below: a caller without env streams samples from this client's RNG
            value = inputs[name]
            device = getattr(value, "device", "cpu")
            if str(getattr(device, "type", device)) != "cpu":
                raise ValueError(
                    f"slot transport takes CPU tensors only; {name!r} is on {device}. "
                    "Keep env workers on the CPU and let the server move batches to the policy device."
                )
            array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            if array.shape[0] > self.capacity:
                raise ValueError(f"{array.shape[0]} rows do not fit slot {self.slot} ({self.capacity} rows)")
            if array.shape[1:] != target.shape[1:]:
                raise ValueError(f"{name!r} has row shape {array.shape[1:]}, the slot holds {target.shape[1:]}")
            rows = array.shape[0]
            target[:rows] = array
        if NOISE_KEY in self.request and NOISE_KEY not in inputs:
            if self._rng is None:
                self._rng = np.random.default_rng()
            target = self.request[NOISE_KEY]
            target[:rows] = fresh_uniforms(self._rng, rows, target.shape[1])
        if hasattr(mode, "numpy"):
            mode = mode.numpy()
        self.modes[:rows] = mode
        self.submit(rows)
        return SlotFuture(self, rows)

    def wait(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Block for the response; raise if the model failed or the server died.

        Returns views of the response slot, valid until the next submit.
        """
        waited = 0.0
        while True:
            while not self._wakeup.acquire(timeout=_PEER_CHECK_S):
                if self._alive.poll():
                    self._in_flight = False
                    raise ServerDiedError(f"the inference server exited while slot {self.slot} waited for actions")
                waited += _PEER_CHECK_S
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"no response for slot {self.slot} within {timeout} s")
            if self._resp_seq[self.slot] == self._req_seq[self.slot]:
                break  # otherwise: the late answer to a dead predecessor's request; wait on
        self._in_flight = False
        if self._status[self.slot] != _OK:
            raw = bytes(self._arena.array("ctl.error")[self.slot])
            raise RemotePolicyError(raw.split(b"\0", 1)[0].decode("utf-8", "replace"))
        return self.response


class SlotFuture:
    """Future of one slot request; ``result()`` returns copies of the rows asked for."""

    def __init__(self, client: SlotClient, rows: int) -> None:
        self._client, self._rows = client, rows
        self._result: dict[str, np.ndarray] | None = None

    def done(self) -> bool:
        return self._result is not None

    def result(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        if self._result is None:
            response = self._client.wait(timeout)
            self._result = {k: v[: self._rows].copy() for k, v in response.items()}
        return self._result
