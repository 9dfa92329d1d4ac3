"""Frame dedup for the image leaves of Dict/Tuple observations, which travel as packed byte rows.

A Dict observation (say a ``[4, 84, 84]`` frame stack beside a few floats of
proprioception) reaches replay as one packed ``uint8`` row per observation
(:mod:`components.obs_tree`). Stored whole, its image leaf repeats every
frame about eight times, as a plain Atari stack would. Here each row is split
on the way in: the image leaves chosen by :func:`~components.obs_tree.frame_leaves`
go to a :class:`~components.replay.frames.FrameStackStorage` as frame stacks
(each frame stored once, matched across a transition's observation and
successor and across steps of its env), and the rest of the row (the other
leaves and the alignment padding) is stored as a short byte row. :meth:`get`
puts the row back together byte for byte, so samplers, n-step returns and
trainers see exactly the rows the collector delivered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from components.obs_tree import ObsLeaf, frame_leaves, packed_size
from components.replay.frame_match import FrameBatch
from components.replay.frames import FrameStackStorage
from components.replay.storage import Key, leaves_of, rows_of, to_tensordict


def _as_key(key: str | Sequence[str]) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


def _frames_key(leaf_index: int, key: Key) -> Key:
    """Where image leaf ``leaf_index`` of packed key ``key`` goes in the frame storage (outside ``key``'s subtree)."""
    return (f"_leaf_frames{leaf_index}", *key)


class TreeFrameStorage:
    """Circular storage of packed Dict/Tuple observations whose image leaves keep each frame once.

    Same interface as :class:`~components.replay.storage.TensorStorage`. The
    packed keys (``observation`` and ``("next", "observation")`` by default)
    must be ``uint8 [N, packed]`` rows of ``leaves``' layout; every other key
    is stored as it comes.

    Args:
        capacity: the number of transitions kept.
        leaves: the observation tree's leaves (``EnvSpec.obs_leaves``); at
            least one must be an image leaf.
        frame_capacity: frames in the pool (see :class:`FrameStackStorage`).
        path: a directory for memory-mapped storage; ``None`` keeps it in RAM.
        packed_keys: the keys holding packed rows.
        env_key: the key naming each transition's env (frames are matched within one env).

    Examples:
        >>> import gymnasium as gym
        >>> from components.obs_tree import pack, tree_leaves
        >>> space = gym.spaces.Dict({"pixels": gym.spaces.Box(0, 255, (2, 36, 36), np.uint8),
        ...                          "speed": gym.spaces.Box(-1, 1, (1,), np.float32)})
        >>> leaves, _ = tree_leaves(space)
        >>> frame = [np.full((36, 36), i, np.uint8) for i in range(5)]                # frames 0..4
        >>> rows = [pack(leaves, {"pixels": np.stack(frame[i:i + 2]), "speed": np.float32([i])}) for i in range(4)]
        >>> batch = TensorDict({"observation": torch.from_numpy(np.stack(rows[:3])),
        ...                     "next": {"observation": torch.from_numpy(np.stack(rows[1:]))}}, [3])
        >>> s = TreeFrameStorage(8, leaves)
        >>> s.extend(batch).tolist()
        [0, 1, 2]
        >>> s.frames_written                             # 5 distinct frames, not 12
        5
        >>> bool((s.get([0, 1, 2])["next", "observation"] == batch["next", "observation"]).all())
        True
    """

    may_invalidate = True

    def __init__(
        self,
        capacity: int,
        leaves: Sequence[ObsLeaf],
        *,
        frame_capacity: int | None = None,
        path: str | Path | None = None,
        packed_keys: Sequence[str | Sequence[str]] = ("observation", ("next", "observation")),
        env_key: str | Sequence[str] = "env_index",
        recent_frames: int = 16,
    ) -> None:
        self.leaves = tuple(leaves)
        self.frame_leaves = frame_leaves(self.leaves)
        if not self.frame_leaves:
            raise ValueError(f"no image leaf to store a frame at a time among {', '.join(l.name for l in leaves)} "
                             "(uint8 [stack, H, W], at least 36x36)")
        self.packed_keys = [_as_key(k) for k in packed_keys]
        self.row_bytes = packed_size(self.leaves)
        rest = np.ones(self.row_bytes, bool)
        for leaf in self.frame_leaves:
            rest[leaf.offset:leaf.offset + leaf.nbytes] = False
        #: the row's bytes outside the frame leaves (None: the image leaves fill the row)
        self._rest = torch.from_numpy(np.flatnonzero(rest)) if rest.any() else None
        frame_keys = [_frames_key(j, key) for j in range(len(self.frame_leaves)) for key in self.packed_keys]
        self._frames = FrameStackStorage(capacity, frame_capacity=frame_capacity, path=path, frame_keys=frame_keys,
                                         env_key=env_key, recent_frames=recent_frames)
        self.capacity = self._frames.capacity
        self.path = self._frames.path

    # -- what FrameStackStorage knows ------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._frames)

    @property
    def cursor(self) -> int:
        return self._frames.cursor

    @property
    def frames_written(self) -> int:
        return self._frames.frames_written

    @property
    def frame_capacity(self) -> int | None:
        return self._frames.frame_capacity

    @property
    def frame_bytes(self) -> int:
        return self._frames.frame_bytes

    @property
    def nbytes(self) -> int:
        return self._frames.nbytes

    @property
    def naive_bytes_per_transition(self) -> int:
        """What the packed keys would take stored whole."""
        return len(self.packed_keys) * self.row_bytes

    def __repr__(self) -> str:
        names = ", ".join(leaf.name for leaf in self.frame_leaves)
        return f"{type(self).__name__}(frames of {names}: {self._frames!r})"

    def valid_mask(self, indices: Any) -> torch.Tensor:
        return self._frames.valid_mask(indices)

    def flush(self) -> None:
        self._frames.flush()

    # -- writing ---------------------------------------------------------------------------------
    def extend(self, batch: TensorDictBase) -> torch.Tensor:
        """Write ``batch`` (batch size ``[N]``) at the cursor; returns the slots written (int64)."""
        return self.write(self.prepare(batch))

    def prepare(self, batch: TensorDictBase) -> FrameBatch:
        """Split each packed row into its image leaves' frame stacks and the rest of its bytes (no shared state)."""
        rows = rows_of(batch)
        leaves = leaves_of(batch)
        for key in self.packed_keys:
            packed = leaves.pop(key, None)
            if packed is None:
                raise KeyError(f"TreeFrameStorage needs the packed key {key} in every batch")
            if packed.dtype != torch.uint8 or tuple(packed.shape) != (rows, self.row_bytes):
                raise ValueError(f"{key}: expected packed rows uint8 [{rows}, {self.row_bytes}], "
                                 f"got {str(packed.dtype).removeprefix('torch.')} {list(packed.shape)}")
            packed = packed.cpu()
            for j, leaf in enumerate(self.frame_leaves):
                leaves[_frames_key(j, key)] = packed[:, leaf.offset:leaf.offset + leaf.nbytes].reshape(
                    rows, *leaf.shape)
            if self._rest is not None:
                leaves[key] = packed.index_select(1, self._rest)
        return self._frames.prepare(to_tensordict(leaves, rows))

    def write(self, prepared: FrameBatch) -> torch.Tensor:
        return self._frames.write(prepared)

    # -- reading ---------------------------------------------------------------------------------
    def get(self, indices: Any) -> TensorDict:
        """The transitions at ``indices``, their packed rows put back together byte for byte.

        Raises:
            IndexError: if one of them lost frames to the pool's wrap-around (see :meth:`valid_mask`).
        """
        got = self._frames.get(indices)
        n = int(got.batch_size[0])
        for key in self.packed_keys:
            packed = torch.empty((n, self.row_bytes), dtype=torch.uint8)
            if self._rest is not None:
                packed.index_copy_(1, self._rest, got.get(key))
            for j, leaf in enumerate(self.frame_leaves):
                frames = got.pop(_frames_key(j, key))
                packed[:, leaf.offset:leaf.offset + leaf.nbytes] = frames.reshape(n, leaf.nbytes)
            got.set(key, packed)
        for j in range(len(self.frame_leaves)):  # the emptied sub-trees the frame keys left behind
            got.pop(f"_leaf_frames{j}", None)
        return got

    def field(self, key: str | Sequence[str]) -> torch.Tensor:
        """A whole per-transition column (not the packed keys: their image leaves are shared frames)."""
        key = _as_key(key)
        if key in self.packed_keys:
            raise KeyError(f"{key} is stored as shared frames and the rest of its row; use get()")
        return self._frames.field(key)

    # -- checkpointing ---------------------------------------------------------------------------
    def _layout(self) -> list[list[Any]]:
        return [[leaf.name, leaf.offset, leaf.nbytes, list(leaf.shape)] for leaf in self.frame_leaves]

    def state_dict(self) -> dict[str, Any]:
        """FrameStackStorage's state (its ``rows`` where a resume checks them) and the packed layout it split."""
        state = self._frames.state_dict()
        state["packed"] = {"row_bytes": self.row_bytes, "frame_leaves": self._layout()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; the packed layout must be this storage's."""
        saved = state.get("packed")
        if not isinstance(saved, Mapping):
            raise ValueError("this state_dict comes from a storage of whole observations, not of split packed rows")
        mine = {"row_bytes": self.row_bytes, "frame_leaves": self._layout()}
        if {"row_bytes": saved.get("row_bytes"), "frame_leaves": saved.get("frame_leaves")} != mine:
            raise ValueError(f"this state_dict splits rows of {saved.get('row_bytes')} bytes at "
                             f"{saved.get('frame_leaves')}; this storage splits {mine['row_bytes']} at "
                             f"{mine['frame_leaves']}")
        self._frames.load_state_dict({k: v for k, v in state.items() if k != "packed"})
