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
