"""Batch memory: big fields reuse the pages of batches the consumer let go, never of ones it keeps."""

from __future__ import annotations

import gc

import torch

from components.collector.batch_memory import BatchMemory

SHAPE = (64, 128, 128)  # 1 MiB of uint8: pooled


def test_a_dropped_batch_field_is_reused_without_a_new_allocation():
    memory = BatchMemory()
    first = memory.empty(SHAPE, torch.uint8)
    address = first.data_ptr()
    del first
    gc.collect()
    second = memory.empty(SHAPE, torch.uint8)
    assert second.data_ptr() == address and memory.allocated == 1


def test_a_kept_batch_keeps_its_memory_and_its_values():
    memory = BatchMemory()
    kept = memory.empty(SHAPE, torch.uint8)
    kept.fill_(7)
    other = memory.empty(SHAPE, torch.uint8)
    other.fill_(1)
    assert other.data_ptr() != kept.data_ptr() and memory.allocated == 2
    assert int(kept.min()) == int(kept.max()) == 7


def test_a_view_of_a_batch_holds_its_memory_like_the_batch():
    """A trainer that keeps a minibatch slice (or the replay a view) keeps the buffer out of the pool."""
    memory = BatchMemory()
    batch = memory.empty(SHAPE, torch.uint8)
    half = batch[:32]
    address = batch.data_ptr()
    del batch
    gc.collect()
    again = memory.empty(SHAPE, torch.uint8)
    assert again.data_ptr() != address
    del half
    gc.collect()
    assert memory.free_buffers() == 1  # the slice was the last user: its buffer went back


def test_small_fields_and_the_free_list_bound():
    memory = BatchMemory(keep=1)
    small = memory.empty((16, 4), torch.float32)
    assert small.shape == (16, 4) and memory.allocated == 0
    batches = [memory.empty(SHAPE, torch.uint8) for _ in range(3)]
    del batches
    gc.collect()
    assert memory.free_buffers() == 1  # the other two were freed, not kept for good
