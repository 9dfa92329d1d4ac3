"""The layers every default model is built from: orthogonally initialised MLPs and the Nature CNN.

Kept apart from :mod:`components.models` so the observation inputs
(:mod:`components.obs_input`), which encode each leaf of a Dict/Tuple
observation with one of them, can use them without a cycle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


def layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    # Orthogonal init with per-layer gains: the PPO implementation detail
    # that matters most for fast, stable early learning (Huang et al. 2022).
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


def mlp(in_dim: int, hidden: Sequence[int], activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [layer_init(nn.Linear(in_dim, width)), activation()]
        in_dim = width
    return nn.Sequential(*layers)


class NatureCNN(nn.Module):
    """The DQN Nature encoder; uint8 frames are scaled to [0, 1] inside.

    ``width``: the frames' width where it differs from their height
    (``screen_size``), for image leaves of a Dict observation.
    """

    def __init__(self, in_channels: int, screen_size: int = 84, features: int = 512, width: int | None = None) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            layer_init(nn.Conv2d(in_channels, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, in_channels, screen_size, width or screen_size)).shape[1]
        self.fc = nn.Sequential(layer_init(nn.Linear(flat, features)), nn.ReLU())
        self.out_dim = features

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.fc(self.convs(obs.float() / 255.0))
