"""Observations as the float features an encoder reads: values as they are, or categories one-hot.

A Discrete observation (FrozenLake's cell, Taxi's state) is a category,
not a number: fed to an MLP as a float, cell 15 would be "fifteen times"
cell 1. Categorical observations (Discrete, MultiDiscrete) are one-hot
encoded here, each component over its own categories, concatenated; past
:data:`ONE_HOT_MAX` categories in all a learned embedding per component
replaces the one-hot (its width stays small whatever the count).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from components.envs import EnvSpec

#: most categories (summed over components) still one-hot encoded; beyond, an embedding of EMBEDDING_DIM each
ONE_HOT_MAX = 1024
EMBEDDING_DIM = 32


class ObservationInput(nn.Module):
    """``obs`` rows -> ``[rows, out_dim]`` float features (a flat view of box and binary observations).

    Examples:
        >>> spec = EnvSpec((), "int64", "discrete", action_n=4, obs_kind="discrete", obs_nvec=(3,), obs_start=(1,))
        >>> ObservationInput(spec)(torch.tensor([1, 3])).tolist()
        [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    """

    def __init__(self, spec: EnvSpec) -> None:
        super().__init__()
        self.categorical = spec.categorical_obs
        self.embedding: nn.Embedding | None = None
        if not self.categorical:
            self.out_dim = int(math.prod(spec.obs_shape)) if spec.obs_shape else 1
            return
        nvec = torch.tensor(spec.obs_nvec, dtype=torch.long)
        offsets = torch.cumsum(nvec, 0) - nvec  # where each component's categories begin in the one-hot
        self.register_buffer("first", offsets - torch.tensor(spec.obs_start, dtype=torch.long), persistent=False)
        self.total = int(nvec.sum())
        if self.total <= ONE_HOT_MAX:
            self.out_dim = self.total
        else:
            self.embedding = nn.Embedding(self.total, EMBEDDING_DIM)
            self.out_dim = EMBEDDING_DIM * len(spec.obs_nvec)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        rows = obs.shape[0]
        if not self.categorical:
            return obs.reshape(rows, -1).float()
        index = obs.reshape(rows, -1).long() + self.first  # [rows, components], into the concatenated categories
        if self.embedding is not None:
            return self.embedding(index).reshape(rows, -1)
        return F.one_hot(index, self.total).sum(1).float()
