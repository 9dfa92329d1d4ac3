"""A recurrent policy's state on the data plane: its request keys and fields, without importing torch.

Env workers import this (a worker with the numpy engine never loads torch);
the models themselves are in :mod:`components.recurrent`.
"""

from __future__ import annotations

from typing import Any

from components.shm import FieldSpec

#: request key of the per-row "first step of an episode" flag (the state is zeroed there)
IS_FIRST = "is_first"


def state_leaves(model: Any) -> dict[str, tuple[int, ...]]:
    """The recurrent state leaves a model declares, name -> per-row shape (empty for a feed-forward one)."""
    leaves = getattr(model, "recurrent_state", None)
    return {str(k): tuple(int(d) for d in v) for k, v in dict(leaves or {}).items()}


def state_fields(leaves: dict[str, tuple[int, ...]]) -> list[FieldSpec]:
    """Request fields of a recurrent model's state leaves and the episode-start flag (none for a feed-forward one)."""
    if not leaves:
        return []
    return [*(FieldSpec(key, shape, "float32") for key, shape in leaves.items()), FieldSpec(IS_FIRST, (), "bool")]
