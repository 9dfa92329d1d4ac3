"""Shared chunk buffers: how transitions travel from workers to the driver.

A chunk holds ``chunk_len`` consecutive steps of one worker's env block
(``[chunk_len, rows]`` per field). Each worker owns ``chunks_per_worker``
chunks and cycles through them in order; a full chunk is announced to the
driver by writing its id into a ready ring, so only an integer crosses
processes. The driver releases a chunk once it has copied it out.

Backpressure is the free-chunk semaphore of each worker: completed plus
in-flight chunks never exceed ``num_workers * chunks_per_worker``, so a
stalled trainer pauses collection instead of growing memory.

With an *observation stream* (``stream="observation"``) a chunk stores each
frame once: ``observation`` holds ``chunk_len + 1`` steps (row ``t + 1`` is
what followed step ``t``, and what the policy acts on next), and
``next.observation`` only the final observations of episodes that ended
(where row ``t + 1`` holds the reset's). The driver derives the successor
as it copies a chunk out: the stream shifted by one step, the finals where
``next.done``. A 100 KB frame then costs the worker one copy into shared
memory instead of three (measured: each such copy out of the caches took
about 22 us on the 2-CPU machine, a sixth of the whole frame's budget).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from components.lifecycle import take_shared_lock
from components.shm import FieldSpec, SharedArena, lane_field, lanes

#: A writer holds the ring lock for three stores; held longer, its holder was killed inside.
_ABANDONED_LOCK_S = 1.0


class ChunkPool:
    """Chunk buffers, per-worker free counters and one ready ring.

    ``ctx`` supplies ``Semaphore``/``Lock``: the ``threading`` module for
    thread workers, a ``spawn`` multiprocessing context for processes. The
    buffers live in a :class:`SharedArena` either way.

    Examples:
        >>> pool = ChunkPool([FieldSpec("x", (), "float32")], rows=[2], chunk_len=3,
        ...                  chunks_per_worker=2, ctx=threading)
        >>> writer = pool.writer(0)
        >>> chunk = writer.acquire(timeout=1.0)
        >>> chunk["x"][:] = 7.0
        >>> writer.commit()
        >>> gid = pool.next_ready(timeout=1.0)
        >>> pool.flat(gid)["x"].tolist()
        [7.0, 7.0, 7.0, 7.0, 7.0, 7.0]
        >>> pool.release(gid)
    """

    def __init__(
        self,
        fields: Sequence[FieldSpec],
        *,
        rows: Sequence[int],
        chunk_len: int,
        chunks_per_worker: int,
        ctx: Any,
        stream: str | None = None,
        dense_successor: bool = True,
    ) -> None:
        if chunk_len < 1 or chunks_per_worker < 1:
            raise ValueError("chunk_len and chunks_per_worker must be >= 1")
        names = {f.name for f in fields}
        if stream is not None and (stream not in names or f"next.{stream}" not in names or "next.done" not in names):
            raise ValueError(f"a stream of {stream!r} needs the fields {stream!r}, 'next.{stream}' and 'next.done'")
        #: the field stored as a stream of ``chunk_len + 1`` steps (its successor derived on read), or None
        self.stream = stream
        #: the stream's successor field (``next.<stream>``: only episodes' finals are stored in it), or None
        self.successor = None if stream is None else f"next.{stream}"
        #: False: :meth:`copy_into` and :meth:`gather_into` leave the stream's successor out (a trainer that reads
        #: it only where trajectories are cut gets those from :meth:`cut_successors`)
        self.dense_successor = stream is None or dense_successor
        self.fields = list(fields)
        self.rows = list(rows)
        self.num_workers = len(self.rows)
        self.chunk_len = chunk_len
        self.chunks_per_worker = chunks_per_worker
        total = self.num_workers * chunks_per_worker
        width = max(self.rows)
        arena_fields = [f.with_leading(total, chunk_len + (f.name == stream), width) for f in self.fields]
        arena_fields += [FieldSpec("ctl.ring", (total,), "int64"), FieldSpec("ctl.written", (1,), "int64"),
                         # per worker: the chunk it fills next, and whether it holds one (a restarted
                         # worker goes on where its predecessor stopped)
                         lane_field("ctl.next", self.num_workers, "int64"),  # each worker's own: lanes
                         lane_field("ctl.writing", self.num_workers, "int8")]
        self._arena = SharedArena(arena_fields)
        self._ready = ctx.Semaphore(0)
        self._ring_lock = ctx.Lock()
        self._free = [ctx.Semaphore(chunks_per_worker) for _ in range(self.num_workers)]
        self._read = 0
        self._flat: dict[int, dict[str, Any]] = {}
        self._np_flat: dict[int, dict[str, np.ndarray]] = {}
        self._banks: dict[str, Any] = {}
        self._sources: list[tuple[str, np.ndarray, tuple[int, ...]]] | None = None

    @property
    def capacity_frames(self) -> int:
        """Most transitions that can be buffered (completed or being written)."""
        return sum(self.rows) * self.chunk_len * self.chunks_per_worker

    def writer(self, worker: int) -> ChunkWriter:
        return ChunkWriter(self._arena, self.fields, worker, self.rows[worker], self.chunk_len,
                           self.chunks_per_worker, self._free[worker], self._ready, self._ring_lock, self.stream)

    # ------------------------------------------------------------ driver side
    def next_ready(self, timeout: float) -> int | None:
        """Id of the oldest complete chunk, or None after ``timeout`` seconds."""
        if not self._ready.acquire(timeout=timeout):
            return None
        ring = self._arena.array("ctl.ring")
        gid = int(ring[self._read % ring.shape[0]])
        self._read += 1
        return gid

    def worker_of(self, gid: int) -> int:
        return gid // self.chunks_per_worker

    def frames_in(self, gid: int) -> int:
        return self.chunk_len * self.rows[self.worker_of(gid)]

    def _views(self, gid: int) -> dict[str, Any]:
        """Torch views of chunk ``gid``'s fields as stored, ``[steps, rows, ...]``."""
        views = self._flat.get(gid)
        if views is None:
            rows = self.rows[self.worker_of(gid)]
            views = {}
            for f in self.fields:
                t = self._arena.tensor(f.name)[gid]
                if rows != t.shape[1]:
                    t = t[:, :rows]  # a narrower last worker: not contiguous, copied on read
                views[f.name] = t
            self._flat[gid] = views
        return views

    def flat(self, gid: int) -> dict[str, Any]:
        """Chunk ``gid`` flattened to ``[chunk_len * rows, ...]`` in (step, env) order.

        Views, except a stream's successor (``next.observation``), which is
        derived into a new tensor: :meth:`copy_into` writes it where it goes
        without that intermediate.
        """
        views = self._views(gid)
        out = {k: v[: self.chunk_len].reshape(-1, *v.shape[2:]) for k, v in views.items()}
        if self.stream is not None:
            import torch

            successor = torch.empty_like(out[self.successor])
            self._derive(gid, 0, successor.shape[0], successor, 0)
            out[self.successor] = successor
        return out

    def copy_into(self, gid: int, start: int, take: int, out: dict[str, Any], pos: int) -> None:
        """Frames ``start:start + take`` of chunk ``gid`` into ``out[key][pos:pos + take]``: one copy per field."""
        # numpy's copy: torch's costs ~4 us more a call on a small field and moves a 210x160x3 frame at about two
        # thirds of numpy's rate (20 against 13 us a frame, one thread), which the driver paid per frame. A narrower
        # last worker's rows are not contiguous in the bank: its reshape copies them first, as torch's did.
        for key, view in self._numpy_views(gid).items():
            if key != self.successor:
                target = out[key].numpy()
                target[pos : pos + take] = view[: self.chunk_len].reshape(-1, *view.shape[2:])[start : start + take]
        if self.successor is not None and self.dense_successor:
            self._derive(gid, start, take, out[self.successor], pos)

    def cut_successors(self, gid: int, start: int, take: int) -> tuple[Any, Any, Any]:
        """``(env_index, env_step, successor)`` of frames ``start:start + take`` of chunk ``gid`` whose next may be elsewhere.

        Those are each env's last frame among them and every frame whose
        episode ended (its successor is the final observation, not the
        stream's next row); every other frame's successor is the observation
        of its env's next frame, in the same span. New tensors, read with
        numpy (a torch index costs microseconds, and this runs per chunk).
        """
        import torch

        views = self._numpy_views(gid)
        rows = self.rows[self.worker_of(gid)]
        stream = views[self.stream]
        end = start + take
        first = max(start, end - rows)  # in (step, env) order, each env's last frame of the span from here
        # Their successors are the stream's frames one step on: at most two runs of a step's rows, sliced.
        step, env = divmod(first + rows, rows)
        if end - first <= rows - env:
            successors = stream[step, env : env + end - first].copy()
        else:
            successors = np.concatenate([stream[step, env:], stream[step + 1, : end - first - (rows - env)]])
        frames = np.arange(first, end)
        done = views["next.done"].reshape(-1)[start:end]
        if done.any():  # an episode's successor is its final observation, kept apart from the stream
            ended = start + np.flatnonzero(done)
            final = views[self.successor][ended // rows, ended % rows]
            last = ended >= first
            successors[ended[last] - first] = final[last]
            frames = np.concatenate([frames, ended[~last]])
            successors = np.concatenate([successors, final[~last]])
        steps, envs = frames // rows, frames % rows
        return (torch.from_numpy(views["env_index"][steps, envs]), torch.from_numpy(views["env_step"][steps, envs]),
                torch.from_numpy(successors))

    def _numpy_views(self, gid: int) -> dict[str, np.ndarray]:
        """Numpy views of chunk ``gid``'s fields as stored, ``[steps, rows, ...]``."""
        views = self._np_flat.get(gid)
        if views is None:
            rows = self.rows[self.worker_of(gid)]
            views = self._np_flat[gid] = {f.name: self._arena.array(f.name)[gid, :, :rows] for f in self.fields}
        return views

    def _derive(self, gid: int, start: int, take: int, target: Any, pos: int) -> None:
        """A stream's successor of frames ``start:start + take`` into ``target[pos:]``: shifted, finals patched."""
        views = self._numpy_views(gid)  # numpy's copies (see copy_into)
        stream = views[self.stream]
        shifted = stream[1:].reshape(-1, *stream.shape[2:])  # step t + 1 of the frame at step t
        out = target.numpy()
        out[pos : pos + take] = shifted[start : start + take]
        ended = np.flatnonzero(views["next.done"].reshape(-1)[start : start + take])
        if ended.size:
            finals = views[self.successor].reshape(-1, *stream.shape[2:])
            out[pos + ended] = finals[start + ended]

    def full_width(self, gid: int) -> bool:
        """Whether chunk ``gid`` uses every row of the bank (so chunks can be gathered in one op)."""
        return self.rows[self.worker_of(gid)] == max(self.rows)

    def gather_into(self, gids: Sequence[int], out: dict[str, Any], start: int) -> int:
        """Copy whole full-width chunks ``gids`` into ``out[key][start:]``: one gather per field."""
        import torch

        per_chunk = self.chunk_len * max(self.rows)
        frames = len(gids) * per_chunk
        end = start + frames
        # one numpy copy per chunk and field: torch.index_select moved four chunks of 210x160x3 frames at 30 us a
        # frame against numpy's 14, and four small chunks of a field in 2.3-3.8 us against 2.0-3.4
        for name, bank, shape in self._gather_sources():
            target = out[name].numpy()[start:end].reshape(len(gids), *shape)
            for k, gid in enumerate(gids):
                target[k] = bank[gid]
        successor = self.successor
        if successor is not None and self.dense_successor:
            # every chunk's episode ends at once, from the done flags just gathered: one index op, not one per chunk
            ended = out["next.done"][start:end].nonzero().squeeze(1)
            if ended.numel():
                finals = self._bank(successor)
                finals = finals.view(finals.shape[0], per_chunk, *finals.shape[3:])
                chunk, step = ended.div(per_chunk, rounding_mode="floor"), ended.remainder(per_chunk)
                out[successor][start + ended] = finals[torch.tensor(gids, dtype=torch.long)[chunk], step]
        return frames

    def _gather_sources(self) -> list[tuple[str, np.ndarray, tuple[int, ...]]]:
        """Per field: its name, the bank :meth:`gather_into` reads whole chunks of, and one chunk's shape there.

        A stream's observation bank is read for its first ``chunk_len``
        steps, and shifted by one for the successor (whose finals
        :meth:`gather_into` patches). Made once: the banks never move.
        """
        sources = self._sources
        if sources is None:
            sources = []
            for f in self.fields:
                if f.name == self.successor and not self.dense_successor:
                    continue
                bank = self._arena.array(f.name)
                if f.name == self.successor:
                    bank = self._arena.array(self.stream)[:, 1:]
                elif f.name == self.stream:
                    bank = bank[:, : self.chunk_len]
                sources.append((f.name, bank, tuple(bank.shape[1:])))
            self._sources = sources
        return sources

    def _bank(self, name: str) -> Any:
        bank = self._banks.get(name)
        if bank is None:
            bank = self._banks[name] = self._arena.tensor(name)
        return bank

    def release(self, gid: int) -> None:
        """Hand chunk ``gid`` back to its worker."""
        self._free[self.worker_of(gid)].release()

    def reclaim(self, worker: int) -> None:
        """After ``worker`` died: give back the chunk it was filling, so its successor starts there.

        The dead worker's committed chunks stay in the ring and are delivered
        as usual; only the half-filled one is dropped (its transitions were
        never announced).
        """
        writing, nxt = lanes(self._arena.array("ctl.writing")), lanes(self._arena.array("ctl.next"))
        ring, written = self._arena.array("ctl.ring"), self._arena.array("ctl.written")
        take_shared_lock(self._ring_lock, _ABANDONED_LOCK_S)  # it may have died inside commit's lock
        try:
            if not writing[worker]:
                return
            writing[worker] = 0
            gid = worker * self.chunks_per_worker + (int(nxt[worker]) - 1) % self.chunks_per_worker
            published = any(int(ring[i % ring.shape[0]]) == gid for i in range(self._read, int(written[0])))
            if published:  # killed in commit after the ring took it, before announcing it: announced here
                self._ready.release()
            else:  # half-filled: its successor starts in it
                nxt[worker] = (nxt[worker] - 1) % self.chunks_per_worker
                self._free[worker].release()
        finally:
            self._ring_lock.release()


class ChunkWriter:
    """A worker's end of the pool: fill chunks in order, commit, repeat."""

    def __init__(self, arena: SharedArena, fields: Sequence[FieldSpec], worker: int, rows: int,
                 chunk_len: int, chunks_per_worker: int, free: Any, ready: Any, ring_lock: Any,
                 stream: str | None = None) -> None:
        self._arena, self._fields, self.worker, self.rows = arena, list(fields), worker, rows
        #: see :class:`ChunkPool`: this field has ``chunk_len + 1`` steps, its ``next.`` only the finals
        self.stream = stream
        self.chunk_len, self._per_worker = chunk_len, chunks_per_worker
        self._free, self._ready, self._ring_lock = free, ready, ring_lock
        self._current: int | None = None
        self._bind()

    def _bind(self) -> None:
        self._ring = self._arena.array("ctl.ring")
        self._written = self._arena.array("ctl.written")
        self._next = lanes(self._arena.array("ctl.next"))
        self._writing = lanes(self._arena.array("ctl.writing"))
        self._chunk_views: dict[int, dict[str, np.ndarray]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_ring", "_written", "_next", "_writing", "_chunk_views"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def acquire(self, timeout: float) -> dict[str, np.ndarray] | None:
        """The next free chunk's arrays (``[chunk_len, rows, ...]``; a stream ``chunk_len + 1``), or None after ``timeout``."""
        if not self._free.acquire(timeout=timeout):
            return None
        w = self.worker
        gid = w * self._per_worker + int(self._next[w])
        self._next[w] = (self._next[w] + 1) % self._per_worker
        self._writing[w] = 1
        self._current = gid
        views = self._chunk_views.get(gid)
        if views is None:
            views = {f.name: self._arena.array(f.name)[gid, :, : self.rows] for f in self._fields}
            self._chunk_views[gid] = views
        return views

    def commit(self) -> None:
        """Announce the current chunk as complete."""
        gid, self._current = self._current, None
        if gid is None:
            raise RuntimeError("commit() without an acquired chunk")
        take_shared_lock(self._ring_lock, _ABANDONED_LOCK_S)  # another worker may have been killed inside
        try:
            index = int(self._written[0])
            self._ring[index % self._ring.shape[0]] = gid
            self._written[0] = index + 1
            # Not writing any more, in the same critical section as the publication: a reclaim (which takes
            # this lock) after a kill sees either an unpublished chunk being written (given back to the
            # successor) or a published one (kept). Cleared after the announcement, as before, a kill in
            # between let the successor write into a chunk the driver was about to read.
            self._writing[self.worker] = 0
        finally:
            self._ring_lock.release()
        self._ready.release()


def thread_context() -> Any:
    """The sync-primitive provider for in-process (thread) pools."""
    return threading
