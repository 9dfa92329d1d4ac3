"""Driver relay: worker processes' requests reach the real server via the driver.

With ``transport=driver`` and process workers, each worker still talks to a
fixed shared slot, but the slots are served by one driver thread instead of
the inference server: it drains whichever workers are ready, forwards them
upstream as one request, and scatters the answer back. It is a
:class:`~components.inference.server.ServeLoop` whose "model" is
:class:`UpstreamPolicy`, so batching, fairness and error delivery are the
server's own code.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from components.inference.slots import SlotClient


class UpstreamPolicy:
    """Looks like a served model; forwards each batch through one upstream slot."""

    in_keys = ("observation",)

    def __init__(self, upstream: SlotClient, timeout: float = 60.0) -> None:
        self._upstream = upstream
        self._timeout = timeout

    def act(self, inputs: dict[str, np.ndarray], modes: np.ndarray) -> dict[str, Any]:
        rows = modes.shape[0]
        for key, target in self._upstream.request.items():
            target[:rows] = inputs[key]
        self._upstream.modes[:rows] = modes
        self._upstream.submit(rows)
        response = self._upstream.wait(self._timeout)
        # Views of the upstream slot: the relay copies them out before its next submit.
        return {k: v[:rows] for k, v in response.items()}
