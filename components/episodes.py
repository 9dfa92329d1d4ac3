"""Episode statistics read off collected batches (returns and lengths at episode ends)."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


class EpisodeTracker:
    """Keeps the last ``window`` finished episodes' returns and lengths.

    Examples:
        >>> t = EpisodeTracker(window=2)
        >>> t.add([1.0, 2.0, 3.0], [10, 20, 30])
        >>> t.mean_return, t.total
        (2.5, 3)
    """

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self.returns: deque[float] = deque(maxlen=window)
        self.lengths: deque[int] = deque(maxlen=window)
        self.total = 0

    def add(self, returns: Any, lengths: Any) -> None:
        self.returns.extend(float(r) for r in returns)
        self.lengths.extend(int(n) for n in lengths)
        self.total += len(returns)

    def add_batch(self, batch: Any) -> int:
        """Record every episode that ended in ``batch``; returns how many did."""
        done = batch["next", "done"]
        if not bool(done.any()):
            return 0
        returns = batch["next", "episode_return"][done].tolist()
        self.add(returns, batch["next", "episode_length"][done].tolist())
        return len(returns)

    @property
    def full(self) -> bool:
        return len(self.returns) == self.window

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.returns)) if self.returns else float("nan")

    @property
    def mean_length(self) -> float:
        return float(np.mean(self.lengths)) if self.lengths else float("nan")


class TaskEpisodes:
    """An :class:`EpisodeTracker` per task of an env set (``task_of``: each env id's task index).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> t = TaskEpisodes(("short", "long"), np.array([0, 1]), window=5)
        >>> batch = TensorDict({"env_index": torch.tensor([0, 1, 1]), "next": TensorDict({
        ...     "done": torch.tensor([True, True, False]), "episode_return": torch.tensor([1.0, 9.0, 0.0]),
        ...     "episode_length": torch.tensor([1, 9, 3])}, [3])}, [3])
        >>> t.add_batch(batch)
        >>> t.row()["episode/long/return_mean"], t.row()["episode/short/count"]
        (9.0, 1)
    """

    def __init__(self, tasks: tuple[str, ...], task_of: np.ndarray, window: int = 20) -> None:
        self.tasks, self.task_of = tasks, np.asarray(task_of)
        self.trackers = [EpisodeTracker(window) for _ in tasks]

    def add_batch(self, batch: Any) -> None:
        done = batch["next", "done"]
        if not bool(done.any()):
            return
        task = self.task_of[batch["env_index"][done].cpu().numpy()]  # batches may be stored on a GPU
        returns = batch["next", "episode_return"][done].cpu().numpy()
        lengths = batch["next", "episode_length"][done].cpu().numpy()
        for i, tracker in enumerate(self.trackers):
            mine = task == i
            if mine.any():
                tracker.add(returns[mine], lengths[mine])

    def row(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, tracker in zip(self.tasks, self.trackers):
            out[f"episode/{name}/return_mean"] = tracker.mean_return
            out[f"episode/{name}/length_mean"] = tracker.mean_length
            out[f"episode/{name}/count"] = tracker.total
        return out
