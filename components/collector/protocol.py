"""What the runner may ask of a collector, whichever graph it drives.

:class:`~components.collector.collector.AsyncBatchedCollector` (workers on
this machine) and :class:`~components.ray.collector.RayCollector` (env hosts
on a Ray cluster) both satisfy it; the trainer loops, the evaluator and the
runner type their collector as this and call nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Collector(Protocol):
    """Exact batches of ``frames_per_batch`` transitions, weights in, statistics out."""

    frames_per_batch: int
    total_frames: int

    def start(self) -> Any: ...

    def __iter__(self) -> Iterator[Any]: ...

    def next_batch(self, frames: int | None = None) -> Any: ...

    def update_policy_weights_(self, weights: torch.nn.Module | Mapping[str, torch.Tensor],
                               version: int | None = None) -> int: ...

    def pause(self, timeout: float = 30.0) -> AbstractContextManager[None]: ...

    def server_stats(self, reset: bool = True) -> dict[str, float]: ...

    def worker_stats(self) -> dict[str, Any]: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def frames(self) -> int: ...

    @property
    def writing(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    def check_writer(self) -> None: ...

    def set_on_batch(self, on_batch: Callable[[Any], None] | None) -> None: ...

    def shutdown(self, timeout: float = 5.0) -> None: ...
