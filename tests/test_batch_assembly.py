"""BatchAssembler: exact batches in arrival order, each chunk freed as soon as it is copied."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch

from components.collector.assembly import BatchAssembler

FRAMES = 4  # per chunk


class ScriptedPool:
    """A chunk pool whose chunks arrive as scripted: some ready at once, the rest only after a blocking wait."""

    fields = [SimpleNamespace(name="x", shape=(), dtype="float32")]
    stream, dense_successor = None, True

    def __init__(self, ready_now: list[int], after_wait: list[int]) -> None:
        self.now, self.later, self.log = deque(ready_now), deque(after_wait), []

    def ready(self) -> int | None:
        return self.now.popleft() if self.now else None

    def wait(self) -> int:
        """One ring: what is ready comes first; only past it does the driver wait."""
        if self.now:
            return self.now.popleft()
        self.log.append(("wait",))
        return self.later.popleft()

    def frames_in(self, gid: int) -> int:
        return FRAMES

    def full_width(self, gid: int) -> bool:
        return True

    def copy_into(self, gid: int, start: int, take: int, out: dict, pos: int) -> None:
        out["x"][pos:pos + take] = torch.arange(start, start + take) + 10.0 * gid

    def gather_into(self, gids: list[int], out: dict, pos: int) -> int:
        for gid in gids:
            self.copy_into(gid, 0, FRAMES, out, pos)
            pos += FRAMES
        return FRAMES * len(gids)

    def release(self, gid: int) -> None:
        self.log.append(("release", gid))


def _assembler(pool: ScriptedPool, early_copy_bytes: int = 1) -> BatchAssembler:
    """``early_copy_bytes=1``: every chunk counts as big (copied as it comes)."""
    return BatchAssembler(pool, pool.wait, pool.ready, early_copy_bytes)  # type: ignore[arg-type]


def test_chunks_that_arrived_are_copied_and_freed_before_the_driver_waits_for_the_rest():
    pool = ScriptedPool(ready_now=[0, 1], after_wait=[2])
    batch = _assembler(pool).next_batch(12)
    assert batch["x"].tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23]
    # the workers of chunks 0 and 1 get them back while chunk 2 is still being filled
    assert pool.log == [("release", 0), ("release", 1), ("wait",), ("release", 2)]


def test_a_chunk_split_by_a_batch_end_is_held_until_its_rest_is_delivered():
    pool = ScriptedPool(ready_now=[0, 1], after_wait=[2])
    assembler = _assembler(pool)
    first = assembler.next_batch(6)
    assert first["x"].tolist() == [0, 1, 2, 3, 10, 11]
    assert pool.log == [("release", 0)], "chunk 1 still holds two frames of the next batch"
    second = assembler.next_batch(6)
    assert second["x"].tolist() == [12, 13, 20, 21, 22, 23]
    assert pool.log == [("release", 0), ("release", 1), ("wait",), ("release", 2)]


def test_small_chunks_are_gathered_once_the_batch_is_in():
    # 4-byte transitions: copying each chunk as it came would cost more calls than it frees buffers
    pool = ScriptedPool(ready_now=[], after_wait=[0, 1, 2])
    batch = _assembler(pool, early_copy_bytes=1 << 20).next_batch(12)
    assert batch["x"].tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23]
    assert pool.log == [("wait",)] * 3 + [("release", 0), ("release", 1), ("release", 2)]
