"""Targets for spawned test processes: numpy only, so they start fast."""

from __future__ import annotations

import time

import numpy as np


def round_trips(client, value: float, count: int) -> None:  # noqa: ANN001
    for i in range(count):
        v = value + i
        client.request["observation"][:] = v
        client.submit()
        action = client.wait(timeout=20)["action"]
        expected = round(3 * v) * 10
        if not np.all(action == expected):
            raise SystemExit(3)


def hammer(client, seconds: float, counts, index: int) -> None:  # noqa: ANN001
    deadline = time.monotonic() + seconds
    client.request["observation"][:] = 1.0
    while time.monotonic() < deadline:
        client.submit()
        client.wait(timeout=20)
        counts[index] += 1


def one_request(client, value: float) -> None:  # noqa: ANN001
    from components.inference.transport import RemotePolicyError

    client.request["observation"][:] = value
    client.submit()
    try:
        action = client.wait(timeout=20)["action"]
    except RemotePolicyError as err:
        raise SystemExit(4 if "NaN" in str(err) else 5) from None
    raise SystemExit(0 if np.all(action == round(3 * value) * 10) else 3)
