"""Locks shared across processes whose holder was SIGKILLed inside them.

A ``multiprocessing`` lock has no owner the OS releases on death: a worker
killed inside ``submit``/``commit`` (a hung worker is replaced by SIGKILL)
or a server killed inside ``drain`` would leave it held, and the next party
to take it would block for good. Each test kills a real process holding the
real lock and bounds how long the survivors take.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from components.collector.chunks import ChunkPool
from components.inference.slots import SlotTransport
from components.inference.transport import Layout, ServerDiedError
from components.shm import FieldSpec

CTX = mp.get_context("spawn")
LAYOUT = Layout((FieldSpec("observation", (3,), "float32"),),
                (FieldSpec("action", (), "int64"), FieldSpec("policy_version", (), "int64")))


def _hold_then_sleep(lock: Any, held: Any) -> None:
    lock.acquire()
    held.set()
    time.sleep(60)


@pytest.fixture
def killed_holder() -> Iterator[Any]:
    """``hold(lock)``: a spawned process takes ``lock`` and is SIGKILLed holding it."""
    processes: list[Any] = []

    def hold(owner: Any, lock_attribute: str) -> None:
        held = CTX.Event()
        process = CTX.Process(target=_hold_lock_of, args=(owner, lock_attribute, held), daemon=True)
        process.start()
        processes.append(process)
        assert held.wait(30), "the stand-in process did not take the lock"
        os.kill(process.pid, signal.SIGKILL)
        process.join(5)
        assert process.exitcode == -signal.SIGKILL

    yield hold
    for process in processes:
        process.kill()
        process.join(5)


def _hold_lock_of(owner: Any, lock_attribute: str, held: Any) -> None:
    _hold_then_sleep(getattr(owner, lock_attribute), held)


def test_a_server_killed_holding_the_slot_lock_fails_a_submitting_thread_instead_of_hanging_it(killed_holder):
    transport = SlotTransport(LAYOUT, num_slots=1, rows_per_slot=2, ctx=CTX)
    client = transport.client()
    killed_holder(transport, "_lock")  # the stand-in server holds the writer end of the liveness pipe too
    transport.release_liveness_handle()  # now the pipe is closed: the only server is dead
    killed = time.monotonic()
    client._checked = killed  # the periodic liveness check before the lock must not be what catches it
    client.request["observation"][:] = 1.0
    with pytest.raises(ServerDiedError, match="exited while slot 0 submitted"):
        client.submit()
    assert time.monotonic() - killed < 2.0


def test_a_worker_killed_holding_the_slot_lock_does_not_hang_the_server(killed_holder):
    transport = SlotTransport(LAYOUT, num_slots=2, rows_per_slot=2, ctx=CTX)
    client = transport.client()
    killed_holder(transport, "_lock")
    started = time.monotonic()
    assert transport.drain(max_rows=8) == []
    assert time.monotonic() - started < 3.0
    client.request["observation"][:] = 1.0
    client.submit()
    assert [(p.handle, p.rows) for p in transport.drain(max_rows=8)] == [(0, 2)]


def test_a_worker_killed_holding_the_ring_lock_does_not_hang_the_others(killed_holder):
    pool = ChunkPool([FieldSpec("x", (), "float32")], rows=[2, 2], chunk_len=3, chunks_per_worker=2, ctx=CTX)
    writer = pool.writer(1)
    killed_holder(pool, "_ring_lock")
    chunk = writer.acquire(timeout=1.0)
    chunk["x"][:] = 5.0
    started = time.monotonic()
    writer.commit()
    assert time.monotonic() - started < 3.0
    gid = pool.next_ready(timeout=1.0)
    assert gid is not None and pool.flat(gid)["x"].tolist()[:6] == [5.0] * 6


def test_a_worker_killed_after_publishing_its_chunk_keeps_it_and_its_successor_writes_the_next():
    """Killed inside commit after the ring took the chunk (before announcing it): the chunk is delivered as it
    is, and the successor never writes into it (it did, when ``writing`` was cleared after the announcement)."""
    import threading

    from components.collector.chunks import ChunkPool
    from components.shm import FieldSpec

    pool = ChunkPool([FieldSpec("x", (), "float32")], rows=[2], chunk_len=2, chunks_per_worker=2, ctx=threading)
    writer = pool.writer(0)
    chunk = writer.acquire(timeout=1.0)
    chunk["x"][:] = 5.0
    gid = writer._current
    ring, written = pool._arena.array("ctl.ring"), pool._arena.array("ctl.written")
    ring[int(written[0]) % ring.shape[0]] = gid  # what commit did before the kill: published, not announced
    written[0] += 1
    pool.reclaim(0)
    assert pool.next_ready(timeout=1.0) == gid and pool.flat(gid)["x"].tolist() == [5.0] * 4
    successor = pool.writer(0)
    assert successor.acquire(timeout=1.0) is not None and successor._current != gid


def test_a_worker_killed_while_filling_a_chunk_gives_it_to_its_successor():
    import threading

    from components.collector.chunks import ChunkPool
    from components.shm import FieldSpec

    pool = ChunkPool([FieldSpec("x", (), "float32")], rows=[2], chunk_len=2, chunks_per_worker=2, ctx=threading)
    writer = pool.writer(0)
    writer.acquire(timeout=1.0)
    gid = writer._current
    pool.reclaim(0)
    assert pool.next_ready(timeout=0.2) is None, "never announced: nothing to deliver"
    successor = pool.writer(0)
    assert successor.acquire(timeout=1.0) is not None and successor._current == gid
