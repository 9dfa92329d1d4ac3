"""The hosts' statistics as one: counts and rates summed, the rest averaged."""

from __future__ import annotations

import math

_SUMMED = ("requests", "batches", "rows", "weight_updates", "requests_per_s", "batches_per_s", "rows_per_s",
           "requests_total", "batches_total", "rows_total", "weight_updates_total", "frames_per_s",
           "non_finite_skipped")


def combine_host_stats(rows: list[dict[str, float]]) -> dict[str, float]:
    """Counts and rates summed over hosts, everything else averaged (NaN-free).

    Examples:
        >>> combine_host_stats([{"rows": 3.0, "env_frac": 0.5}, {"rows": 5.0, "env_frac": float("nan")}])
        {'env_frac': 0.5, 'rows': 8.0}
    """
    keys = {k for row in rows for k in row}
    out = {}
    for key in sorted(keys):
        values = [row[key] for row in rows if key in row and not math.isnan(row[key])]
        if values:
            out[key] = float(sum(values)) if key in _SUMMED or key.endswith("_total") else \
                float(sum(values) / len(values))
    return out
