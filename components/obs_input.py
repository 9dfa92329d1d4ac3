"""Observations as the float features an encoder reads: values as they are, or categories one-hot.

A Discrete observation (FrozenLake's cell, Taxi's state) is a category,
not a number: fed to an MLP as a float, cell 15 would be "fifteen times"
cell 1. Categorical observations (Discrete, MultiDiscrete) are one-hot
encoded here, each component over its own categories, concatenated; past
:data:`ONE_HOT_MAX` categories in all a learned embedding per component
replaces the one-hot (its width stays small whatever the count).

A Dict/Tuple observation arrives as a nested ``TensorDict`` of its leaves
(:mod:`components.obs_tree`; packed rows are read as views too): each leaf
is encoded by what it is (the Nature CNN for a ``uint8 [C, H, W]``
image of 36 pixels or more, one-hot for categories, the values as they are
for vectors and flags) and the features are concatenated, the composite
encoder of RLlib and Sample Factory. The action mask leaf, if any, is not a
feature: :meth:`ObservationInput.mask` hands it to the action head.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from components.encoders import NatureCNN
from components.envs import EnvSpec
from components.obs_tree import ObsLeaf, leaf_tensors

#: most categories (summed over components) still one-hot encoded; beyond, an embedding of EMBEDDING_DIM each
ONE_HOT_MAX = 1024
EMBEDDING_DIM = 32
#: the logit of a masked action: far below any real one, finite so p * log p stays 0 (no NaN in the entropy)
MASKED_LOGIT = -1e8


def masked(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with the actions ``mask`` forbids (False) pushed to :data:`MASKED_LOGIT`."""
    return logits if mask is None else logits.masked_fill(~mask, MASKED_LOGIT)


def is_tensordict(obj: Any) -> bool:
    """Whether ``obj`` is a ``TensorDict``, without importing tensordict (~2 s in a fresh process: it loads
    ``torch._dynamo``): an inference server process or a worker serving torch never needs it, and a TensorDict
    exists only where its maker already imported the package."""
    module = sys.modules.get("tensordict")
    return module is not None and isinstance(obj, module.TensorDictBase)


def tree_values(leaves: Sequence[ObsLeaf], obs: Any) -> list[torch.Tensor]:
    """Each leaf of a tree observation: from its nested ``TensorDict`` (what models are handed), or read
    out of packed rows (a caller holding the data plane's bytes)."""
    if is_tensordict(obs):
        return [obs.get(leaf.key) for leaf in leaves]
    return leaf_tensors(leaves, obs)


def mask_rows(leaf: ObsLeaf, obs: Any) -> torch.Tensor:
    """The action mask leaf ``leaf`` of ``obs`` (a tree or packed rows) as ``[rows, choices]`` bool (non-zero: allowed)."""
    return tree_values([leaf], obs)[0].reshape(obs.shape[0], -1) != 0


class ObservationInput(nn.Module):
    """``obs`` rows -> ``[rows, out_dim]`` float features (a flat view of box and binary observations).

    Examples:
        >>> spec = EnvSpec((), "int64", "discrete", action_n=4, obs_kind="discrete", obs_nvec=(3,), obs_start=(1,))
        >>> ObservationInput(spec)(torch.tensor([1, 3])).tolist()
        [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    """

    def __init__(self, spec: EnvSpec, features: int = 512) -> None:
        super().__init__()
        self.categorical = spec.categorical_obs
        self.embedding: nn.Embedding | None = None
        #: a tree's leaves, the encoder of each feature leaf (in order) and the mask leaf's index
        self.leaves = spec.obs_leaves
        self.parts: nn.ModuleList | None = None
        self.features: list[int] = []
        self.mask_index: int | None = None
        if spec.is_tree:
            self.parts = nn.ModuleList()
            for k, leaf in enumerate(spec.obs_leaves):
                if leaf.name == spec.action_mask:
                    self.mask_index = k
                    continue
                self.features.append(k)
                if leaf.image:
                    self.parts.append(NatureCNN(leaf.shape[0], leaf.shape[1], features, width=leaf.shape[2]))
                else:
                    self.parts.append(ObservationInput(EnvSpec(leaf.shape, leaf.dtype, "discrete", action_n=1,
                                                               obs_kind=leaf.kind, obs_nvec=leaf.nvec,
                                                               obs_start=leaf.start)))
            self.out_dim = sum(int(part.out_dim) for part in self.parts)
            return
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

    def mask(self, obs: torch.Tensor) -> torch.Tensor | None:
        """The action mask of each row (``[rows, choices]`` bool), or None for an env without one."""
        return None if self.mask_index is None else mask_rows(self.leaves[self.mask_index], obs)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        rows = obs.shape[0]
        if self.parts is not None:
            values = tree_values(self.leaves, obs)
            return torch.cat([part(values[k]) for k, part in zip(self.features, self.parts)], dim=-1)
        if not self.categorical:
            return obs.reshape(rows, -1).float()
        index = obs.reshape(rows, -1).long() + self.first  # [rows, components], into the concatenated categories
        if self.embedding is not None:
            return self.embedding(index).reshape(rows, -1)
        return F.one_hot(index, self.total).sum(1).float()
