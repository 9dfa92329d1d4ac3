"""Dict and Tuple observations as a tree of leaves, carried between processes as one packed byte row.

A nested observation (an image plus proprioception, a goal-conditioned
task, ``Blackjack-v1``'s tuple) is a tree of leaves, each a name, a shape, a
dtype and what its values mean (a :class:`ObsLeaf`). The data plane (request
slots, chunks, Ray hosts) moves every observation as one ``uint8`` row of
the tree's packed size: each leaf sits at a fixed, 8-byte-aligned offset,
written there once by the env block (one numpy assignment per leaf per env)
and read back as a view of its own dtype and shape. So the slot and chunk
code paths are the one-leaf ones, untouched and as fast, and every leaf
arrives bit for bit: nothing is cast to a common dtype (RLlib's flattening
preprocessor took the same road, with floats; bytes keep integers and
images exact). Past the data plane every reader sees the tree:
the collector nests a batch's packed fields into ``TensorDict`` keys
(:func:`observation_tree`, views, no copy) and :func:`model_observation`
does the same for what a server hands its model, so trainers, replay and
models read ``("observation", "image")``, never the bytes.

Only numpy is imported at module level: env worker processes use it too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: byte alignment of every leaf in the packed row (a float64/int64 leaf viewed in place needs 8)
ALIGN = 8
#: the leaf kinds: values as they are, categories (one-hot encoded by default models), 0/1 flags
LEAF_KINDS = ("box", "discrete", "multi_discrete", "multi_binary")
SUPPORTED = "Box, Discrete, MultiDiscrete, MultiBinary, and Dict/Tuple of them"


class UnsupportedSpace(ValueError):
    """A space the pipeline cannot carry (Graph, Text, Sequence, ...): one line naming it."""


@dataclass(frozen=True)
class ObsLeaf:
    """One leaf of an observation tree: where it is in the tree and in the packed row.

    ``path`` holds dict keys (str) and tuple indices (int), from the root.
    """

    path: tuple[str | int, ...]
    shape: tuple[int, ...]
    dtype: str
    kind: str = "box"
    #: categories per component (discrete kinds, flattened) and each component's first category
    nvec: tuple[int, ...] = ()
    start: tuple[int, ...] = ()
    #: byte offset of the leaf in the packed row
    offset: int = 0

    @property
    def name(self) -> str:
        """``image``, ``goal/position``, ``0``: the path joined by ``/`` (metrics, errors, docs)."""
        return "/".join(str(p) for p in self.path)

    @functools.cached_property  # read per leaf on every forward: computed once (frozen: it caches in __dict__)
    def key(self) -> tuple[str, ...]:
        """The leaf's nested ``TensorDict`` key."""
        return tuple(str(p) for p in self.path)

    @functools.cached_property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize

    @property
    def categorical(self) -> bool:
        return self.kind in ("discrete", "multi_discrete")

    @property
    def image(self) -> bool:
        """A ``uint8`` ``[C, H, W]`` leaf of at least 36x36 pixels: what the Nature CNN reads."""
        return (self.kind == "box" and self.dtype == "uint8" and len(self.shape) == 3
                and min(self.shape[1:]) >= 36)

    def zero(self) -> np.ndarray:
        """A value every space of this leaf contains (zeros, or each component's first category)."""
        if self.categorical:
            return np.asarray(self.start, np.int64).reshape(self.shape)
        return np.zeros(self.shape, self.dtype)


def _leaf(path: tuple[str | int, ...], space: Any) -> ObsLeaf:
    from gymnasium import spaces

    if isinstance(space, spaces.Box):
        return ObsLeaf(path, tuple(space.shape), np.dtype(space.dtype).name)
    if isinstance(space, spaces.Discrete):
        return ObsLeaf(path, (), "int64", "discrete", (int(space.n),), (int(space.start),))
    if isinstance(space, spaces.MultiDiscrete):
        return ObsLeaf(path, tuple(space.shape), "int64", "multi_discrete",
                       tuple(int(n) for n in np.ravel(space.nvec)), tuple(int(s) for s in np.ravel(space.start)))
    if isinstance(space, spaces.MultiBinary):
        return ObsLeaf(path, tuple(space.shape), "int8", "multi_binary")
    where = f" at {'/'.join(str(p) for p in path)!r}" if path else ""
    raise UnsupportedSpace(f"observation space {space}{where} is not supported ({SUPPORTED})")


def tree_leaves(space: Any) -> tuple[tuple[ObsLeaf, ...], tuple[tuple[str | int, ...], ...]]:
    """The leaves of a Dict/Tuple space, packed in order, and the paths that are Tuples (to rebuild the space).

    A Dict's keys are taken in the space's own order (gymnasium sorts them
    unless given an ordered mapping), so every process packs the same layout.
    """
    from gymnasium import spaces

    leaves: list[ObsLeaf] = []
    tuples: list[tuple[str | int, ...]] = []

    def walk(path: tuple[str | int, ...], node: Any) -> None:
        if isinstance(node, spaces.Dict):
            for key, child in node.spaces.items():
                if not isinstance(key, str):
                    raise UnsupportedSpace(f"observation space Dict key {key!r} is not a string")
                walk((*path, key), child)
        elif isinstance(node, spaces.Tuple):
            tuples.append(path)
            for i, child in enumerate(node.spaces):
                walk((*path, i), child)
        else:
            leaves.append(_leaf(path, node))

    walk((), space)
    if not leaves:
        raise UnsupportedSpace(f"observation space {space} has no leaves")
    placed, offset = [], 0
    for leaf in leaves:
        placed.append(ObsLeaf(leaf.path, leaf.shape, leaf.dtype, leaf.kind, leaf.nvec, leaf.start, offset))
        offset += -(-leaf.nbytes // ALIGN) * ALIGN
    return tuple(placed), tuple(tuples)


def packed_size(leaves: Sequence[ObsLeaf]) -> int:
    last = leaves[-1]
    return max(ALIGN, -(-(last.offset + last.nbytes) // ALIGN) * ALIGN)


def frame_leaves(leaves: Sequence[ObsLeaf]) -> tuple[ObsLeaf, ...]:
    """The image leaves replay's frame dedup stores a frame at a time: those shaped like the largest image leaf.

    An image leaf's first axis is its frame stack (``[stack, H, W]``, as the
    Atari preset and gymnasium's ``FrameStackObservation`` give it). The
    dedup pool holds frames of one shape, so image leaves of another shape
    (a small map beside the camera) are stored whole.
    """
    images = [leaf for leaf in leaves if leaf.image]
    if not images:
        return ()
    largest = max(images, key=lambda leaf: leaf.nbytes)
    return tuple(leaf for leaf in images if leaf.shape == largest.shape)


def leaf_view(rows: np.ndarray, leaf: ObsLeaf) -> np.ndarray:
    """Leaf ``leaf`` of packed ``rows`` (``[..., packed]`` uint8) as a writable view ``[..., *leaf.shape]``."""
    lead = rows.shape[:-1]
    window = rows[..., leaf.offset:leaf.offset + leaf.nbytes]
    view = window.view(leaf.dtype) if leaf.nbytes else window
    return view.reshape((*lead, *leaf.shape))


def leaf_value(obs: Any, path: Sequence[str | int]) -> Any:
    """The value at ``path`` in a nested dict/tuple observation; KeyError/IndexError/TypeError if it is not there."""
    for part in path:
        obs = obs[part]
    return obs


def pack(leaves: Sequence[ObsLeaf], obs: Any, out: np.ndarray | None = None) -> np.ndarray:
    """One observation tree as its packed row (no checks: for code that read it from a checked source)."""
    row = np.zeros(packed_size(leaves), np.uint8) if out is None else out
    for leaf in leaves:
        leaf_view(row, leaf)[...] = leaf_value(obs, leaf.path)
    return row


def unpack(leaves: Sequence[ObsLeaf], rows: np.ndarray) -> dict[str, np.ndarray]:
    """Packed rows as ``{leaf name: view}`` (tests, tools)."""
    return {leaf.name: leaf_view(rows, leaf) for leaf in leaves}


def zero_row(leaves: Sequence[ObsLeaf]) -> np.ndarray:
    row = np.zeros(packed_size(leaves), np.uint8)
    for leaf in leaves:
        leaf_view(row, leaf)[...] = leaf.zero()
    return row


def rebuild_space(leaves: Sequence[ObsLeaf], tuples: Sequence[tuple[str | int, ...]]) -> Any:
    """A gymnasium space of this tree (probes and fake envs step envs built from a spec)."""
    from gymnasium import spaces

    def leaf_space(leaf: ObsLeaf) -> Any:
        if leaf.kind == "discrete":
            return spaces.Discrete(leaf.nvec[0], start=leaf.start[0])
        if leaf.kind == "multi_discrete":
            return spaces.MultiDiscrete(np.reshape(leaf.nvec, leaf.shape), start=np.reshape(leaf.start, leaf.shape))
        if leaf.kind == "multi_binary":
            return spaces.MultiBinary(list(leaf.shape))
        dtype = np.dtype(leaf.dtype)
        if dtype.kind == "f":
            return spaces.Box(-np.inf, np.inf, leaf.shape, dtype)
        if dtype.kind == "b":
            return spaces.Box(0, 1, leaf.shape, dtype)
        info = np.iinfo(dtype)
        return spaces.Box(info.min, info.max, leaf.shape, dtype)

    def build(prefix: tuple[str | int, ...]) -> Any:
        mine = [leaf for leaf in leaves if leaf.path[:len(prefix)] == prefix]
        if len(mine) == 1 and mine[0].path == prefix:
            return leaf_space(mine[0])
        children: list[str | int] = []
        for leaf in mine:
            if leaf.path[len(prefix)] not in children:
                children.append(leaf.path[len(prefix)])
        if prefix in tuples:
            return spaces.Tuple([build((*prefix, c)) for c in children])
        return spaces.Dict({str(c): build((*prefix, c)) for c in children})

    return build(())


def leaf_tensors(leaves: Sequence[ObsLeaf], packed: Any) -> list[Any]:
    """Each leaf of a packed ``[..., packed]`` uint8 tensor as a tensor of its dtype and shape (views).

    On the CPU the views are cut with numpy and wrapped: a third of torch's
    cost per leaf (a server does this on every forward).
    """
    import torch

    packed = packed if packed.is_contiguous() else packed.contiguous()
    if packed.device.type == "cpu" and not packed.requires_grad:
        rows = packed.numpy()
        return [torch.from_numpy(leaf_view(rows, leaf)) for leaf in leaves]
    lead = packed.shape[:-1]
    out = []
    for leaf in leaves:
        window = packed[..., leaf.offset:leaf.offset + leaf.nbytes]
        out.append(window.view(torch_dtype(leaf.dtype)).reshape((*lead, *leaf.shape)))
    return out


def observation_tree(leaves: Sequence[ObsLeaf], packed: Any) -> Any:
    """Packed observations as a nested ``TensorDict`` keyed like the env's Dict/Tuple (tuple index ``"0"``, ...)."""
    from tensordict import TensorDict

    nested: dict[str, Any] = {}
    for leaf, value in zip(leaves, leaf_tensors(leaves, packed)):
        node = nested
        for part in leaf.key[:-1]:
            node = node.setdefault(part, {})
        node[leaf.key[-1]] = value
    return TensorDict(nested, batch_size=packed.shape[:-1], device=packed.device)  # one construction, not one per leaf


def model_observation(leaves: Sequence[ObsLeaf], obs: Any) -> Any:
    """What a model reads: packed rows (a tensor or a numpy view of a slot) as a nested ``TensorDict`` of
    leaf views for a tree, ``obs`` itself for a one-leaf env (``leaves`` empty)."""
    if not leaves:
        return obs
    import torch

    return observation_tree(leaves, torch.as_tensor(obs))


_TORCH_DTYPES: dict[str, Any] = {}


def _torch_dtypes() -> None:  # filled lazily: torch is not imported in env worker processes
    import torch

    _TORCH_DTYPES.update({"bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
                          "int32": torch.int32, "int64": torch.int64, "float16": torch.float16,
                          "float32": torch.float32, "float64": torch.float64, "uint16": torch.uint16,
                          "uint32": torch.uint32, "uint64": torch.uint64})


def torch_dtype(name: str) -> Any:
    if not _TORCH_DTYPES:
        _torch_dtypes()
    return _TORCH_DTYPES[name]
