"""Lock-free reads of the shared policy weights as numpy arrays, without torch.

The trainer publishes into a :class:`~components.inference.weights.SharedWeights`
arena under its lock, raising a ``writing`` flag for the duration and
bumping the publish counter ``seq`` at the end. A reader that may be
killed at any instant (an env worker with the policy inline) must not take
that lock: killed inside it, it would block every other reader and the
trainer. So it copies without the lock and keeps the copy only if no
publish began or ended meanwhile. This module imports numpy alone, so a
worker process that evaluates a numpy policy never imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np


class WeightsReader:
    """Reads a weights arena (``w.<key>`` fields, ``seq``, ``version``, ``writing``) without its lock."""

    def __init__(self, arena: Any, keys: Sequence[str]) -> None:
        self._arena, self._keys = arena, list(keys)
        self._bind()

    def _bind(self) -> None:
        a = self._arena
        self._seq, self._version, self._writing = a.array("seq"), a.array("version"), a.array("writing")
        self._views = {k: a.array("w." + k) for k in self._keys}

    def __getstate__(self) -> dict[str, Any]:
        return {"_arena": self._arena, "_keys": self._keys}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    @property
    def seq(self) -> int:
        """How many times weights were published (0: never)."""
        return int(self._seq[0])

    def read(self, into: dict[str, np.ndarray] | None = None,
             give_up_s: float = 0.05) -> tuple[dict[str, np.ndarray], int, int] | None:
        """A clean copy of the latest weights with their (version, seq); None if none could be had in ``give_up_s``.

        ``into`` (arrays of the right shapes, e.g. the previous result) is
        reused instead of allocating.
        """
        out = into if into is not None else {k: np.empty_like(v) for k, v in self._views.items()}
        deadline = time.monotonic() + give_up_s
        while True:
            seq = int(self._seq[0])
            if not self._writing[0]:
                for key, view in self._views.items():
                    np.copyto(out[key], view)
                version = int(self._version[0])
                if not self._writing[0] and int(self._seq[0]) == seq:
                    return out, version, seq
            if time.monotonic() > deadline:
                return None
            time.sleep(0.0002)
