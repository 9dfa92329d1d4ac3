"""Shared arenas: the memory every process-crossing buffer lives in."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from components.shm import FieldSpec, SharedArena


def _add_in_child(arena: SharedArena, value: float) -> None:
    import sys

    arena.array("x")[:] += value
    arena.array("flags")[0] = "torch" in sys.modules


def test_writes_in_a_spawned_child_are_visible_to_the_parent_without_torch_there():
    arena = SharedArena([FieldSpec("x", (3, 2), "float32"), FieldSpec("flags", (1,), "bool")])
    arena.array("x")[:] = 1.0
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_add_in_child, args=(arena, 2.5))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert np.all(arena.array("x") == 3.5)
    assert not arena.array("flags")[0], "unpickling an arena must not import torch in the child"


def test_torch_views_share_memory_with_numpy_views():
    arena = SharedArena([FieldSpec("a", (4,), "int64")])
    arena.tensor("a")[2] = 7
    assert arena.array("a").tolist() == [0, 0, 7, 0]


def test_fields_are_cache_line_aligned_and_do_not_overlap():
    arena = SharedArena([FieldSpec("a", (3,), "uint8"), FieldSpec("b", (5,), "float64")])
    arena.array("a")[:] = 255
    arena.array("b")[:] = -1.0
    assert arena.array("a").tolist() == [255, 255, 255]
    assert arena.array("b").ctypes.data % 64 == 0


def test_duplicate_field_names_are_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        SharedArena([FieldSpec("a", (1,), "int8"), FieldSpec("a", (1,), "int8")])
