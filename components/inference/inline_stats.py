"""The inline policies' statistics: one shared row per worker, summed by the driver.

Every worker with ``server=inline`` answers its own requests, so there is
no server to count them; each worker writes its own row of this table
(one writer per row, no lock) and :class:`~components.inference.inline.InlineServer`
reads every row to report the server statistics' keys.
"""

from __future__ import annotations

from typing import Any

from components.shm import FieldSpec, SharedArena, lane_field, lanes

#: Columns of a worker's row of the statistics table (cumulative since the run began).
COUNTERS = ("requests", "rows", "weight_updates", "version", "batches")
REQUESTS, ROWS, UPDATES, VERSION, BATCHES = range(len(COUNTERS))
#: Forward durations a worker keeps for the percentiles (a ring; the newest win).
RING = 512


class InlineStatsTable:
    """Per-worker counters and recent forward times in shared memory, one row per worker."""

    def __init__(self, num_workers: int, version: int) -> None:
        self._arena = SharedArena([  # a worker's counters are written every request: lanes, not shared lines
            lane_field("counters", num_workers, "float64", len(COUNTERS)),
            FieldSpec("forward", (num_workers, RING), "float64"),
            lane_field("written", num_workers, "int64"),
        ])
        self._bind()
        self.counters[:, VERSION] = version

    def _bind(self) -> None:
        a = self._arena
        self.counters, self.forward = lanes(a.array("counters"), len(COUNTERS)), a.array("forward")
        self.written = lanes(a.array("written"))
        self._totals: dict[int, list[Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"_arena": self._arena}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def record(self, worker: int, rows: int, seconds: float, passes: int = 1) -> None:
        # A worker's row has one writer: its totals are kept here as Python numbers and stored, not read
        # back and added to (a third of the cost, ~1 us a request; a replacement picks up the row's values).
        mine = self._totals.get(worker)
        if mine is None:
            row = self.counters[worker]
            mine = self._totals[worker] = [float(row[REQUESTS]), float(row[ROWS]), float(row[BATCHES]),
                                           int(self.written[worker]), row, self.forward[worker],
                                           self.written[worker:worker + 1]]
        mine[0] += 1
        mine[1] += rows
        mine[2] += passes
        n = mine[3]
        mine[3] = n + 1
        row = mine[4]
        row[REQUESTS] = mine[0]
        row[ROWS] = mine[1]
        row[BATCHES] = mine[2]
        mine[5][n % RING] = seconds / passes
        mine[6][0] = n + 1

    def record_weights(self, worker: int, version: int) -> None:
        row = self.counters[worker]
        row[UPDATES] += 1
        row[VERSION] = version
