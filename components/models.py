"""Actor-critic networks and the action heads they act through.

Every served model implements one hot-path method, ``act(inputs, modes)``:
plain tensors in, a dict of tensors out, the interaction mode given per row.
Trainers use ``forward``/``evaluate``. Models are rebuilt from a
:class:`ModelSpec` (an import path and keyword arguments) inside an inference
process, so no module is ever pickled.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from components.envs import EnvSpec
from components.interaction import InteractionMode
from components.normalization import RunningNorm


def _layer_init(layer: nn.Module, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Module:
    # Orthogonal init with per-layer gains: the PPO implementation detail
    # that matters most for fast, stable early learning (Huang et al. 2022).
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


def mlp(in_dim: int, hidden: Sequence[int], activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [_layer_init(nn.Linear(in_dim, width)), activation()]
        in_dim = width
    return nn.Sequential(*layers)


class NatureCNN(nn.Module):
    """The DQN Nature encoder; uint8 frames are scaled to [0, 1] inside."""

    def __init__(self, in_channels: int, screen_size: int = 84, features: int = 512) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            _layer_init(nn.Conv2d(in_channels, 32, 8, stride=4)),
            nn.ReLU(),
            _layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            _layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, in_channels, screen_size, screen_size)).shape[1]
        self.fc = nn.Sequential(_layer_init(nn.Linear(flat, features)), nn.ReLU())
        self.out_dim = features

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.fc(self.convs(obs.float() / 255.0))


class CategoricalHead(nn.Module):
    """Discrete actions: samples with the Gumbel-max trick, greedy is argmax."""

    def act(self, logits: torch.Tensor, greedy: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = F.log_softmax(logits, dim=-1)
        noise = torch.rand_like(log_probs).clamp_(min=1e-20).log_().neg_().log_()
        action = (log_probs - noise).argmax(-1)
        if greedy is not None:
            action = torch.where(greedy, log_probs.argmax(-1), action)
        return action, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)

    def evaluate(self, logits: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = F.log_softmax(logits, dim=-1)
        log_prob = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob, entropy


class GaussianHead(nn.Module):
    """Continuous actions: a diagonal Gaussian with a state-independent log-std.

    Actions are sampled unbounded (the env block clips them to the action
    box), so the stored log-probability matches the sampled action exactly.
    """

    def __init__(self, dim: int, init_log_std: float = 0.0) -> None:
        super().__init__()
        self.log_std = nn.Parameter(torch.full((dim,), init_log_std))

    def act(self, mean: torch.Tensor, greedy: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        std = self.log_std.exp()
        action = mean + std * torch.randn_like(mean)
        if greedy is not None:
            action = torch.where(greedy.unsqueeze(-1), mean, action)
        return action, self._log_prob(mean, action)

    def _log_prob(self, mean: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        var = (2 * self.log_std).exp()
        return (-((action - mean) ** 2) / (2 * var) - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def evaluate(self, mean: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + self.log_std).sum().expand(mean.shape[0])
        return self._log_prob(mean, action), entropy


def _greedy_rows(modes: torch.Tensor | None) -> torch.Tensor | None:
    # No "any greedy row?" shortcut: reading it back would synchronise with
    # the device and make the forward impossible to capture in a CUDA graph.
    if modes is None:
        return None
    return modes != int(InteractionMode.RANDOM)


class ActorCritic(nn.Module):
    """Policy and value networks over a vector or image-stack observation.

    ``encoder="mlp"`` uses separate actor and critic MLPs (the CleanRL
    CartPole layout); ``encoder="nature_cnn"`` shares one Nature-CNN trunk
    between the two heads (the CleanRL Atari layout).

    Examples:
        >>> spec = EnvSpec((4,), "float32", "discrete", action_n=2)
        >>> model = ActorCritic(spec, hidden=(16,))
        >>> out = model.act({"observation": torch.zeros(3, 4)}, torch.zeros(3, dtype=torch.int8))
        >>> sorted(out), out["action"].shape
        (['action', 'sample_log_prob', 'state_value'], torch.Size([3]))
    """

    in_keys = ("observation",)
    out_keys = ("action", "sample_log_prob", "state_value")

    def __init__(
        self,
        spec: EnvSpec,
        encoder: str = "mlp",
        hidden: Sequence[int] = (64, 64),
        features: int = 512,
        init_log_std: float = 0.0,
        activation: str = "tanh",
        obs_norm: bool = False,
        obs_clip: float = 10.0,
    ) -> None:
        super().__init__()
        self.spec = spec
        act = _ACTIVATIONS[activation]
        #: running observation normalisation (part of the weights; see components.normalization)
        self.obs_norm: RunningNorm | None = None
        if spec.action_kind == "discrete":
            self.head: nn.Module = CategoricalHead()
            action_dim = spec.action_n
        else:
            action_dim = int(math.prod(spec.action_shape))
            self.head = GaussianHead(action_dim, init_log_std)
        if encoder == "mlp":
            in_dim = int(math.prod(spec.obs_shape)) if spec.obs_shape else 1
            hidden = tuple(hidden)
            self.shared: nn.Module | None = None
            self.actor = nn.Sequential(mlp(in_dim, hidden, act), _layer_init(nn.Linear(hidden[-1], action_dim), 0.01))
            self.critic = nn.Sequential(mlp(in_dim, hidden, act), _layer_init(nn.Linear(hidden[-1], 1), 1.0))
            if obs_norm:
                self.obs_norm = RunningNorm((in_dim,), clip=obs_clip)
        elif encoder == "nature_cnn":
            if obs_norm:
                raise ValueError("obs_norm applies to vector observations (encoder mlp); images are scaled by /255")
            if len(spec.obs_shape) != 3:
                raise ValueError(f"nature_cnn needs [C, H, W] observations, got shape {spec.obs_shape}")
            self.shared = NatureCNN(spec.obs_shape[0], spec.obs_shape[1], features)
            self.actor = _layer_init(nn.Linear(features, action_dim), 0.01)
            self.critic = _layer_init(nn.Linear(features, 1), 1.0)
        else:
            raise ValueError(f"unknown encoder {encoder!r} (allowed: mlp, nature_cnn)")

    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            return self.shared(obs)
        x = obs.reshape(obs.shape[0], -1).float()
        return x if self.obs_norm is None else self.obs_norm(x)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Distribution parameters (logits or mean) and state values."""
        x = self._features(obs)
        return self.actor(x), self.critic(x).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self._features(obs)).squeeze(-1)

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        params, value = self(inputs["observation"])
        action, log_prob = self.head.act(params, _greedy_rows(modes))
        if self.spec.action_kind == "continuous":
            action = action.reshape(action.shape[0], *self.spec.action_shape)
        return {"action": action, "sample_log_prob": log_prob, "state_value": value}

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probability of ``action``, entropy and value, for the loss."""
        params, value = self(obs)
        if self.spec.action_kind == "continuous":
            action = action.reshape(action.shape[0], -1)
        log_prob, entropy = self.head.evaluate(params, action)
        return log_prob, entropy, value


class QNetwork(nn.Module):
    """Action values for discrete actions, acting epsilon-greedily.

    ``epsilon`` is a buffer, so the exploration schedule travels to the
    inference server with the weights: the server never reads it from
    anywhere else. Rows whose interaction mode is ``RANDOM`` explore with
    probability ``epsilon``; every other mode acts greedily.

    Examples:
        >>> net = QNetwork(EnvSpec((4,), "float32", "discrete", action_n=2), hidden=(8,))
        >>> net.epsilon.fill_(0.0)
        tensor(0.)
        >>> out = net.act({"observation": torch.zeros(3, 4)}, torch.zeros(3, dtype=torch.int8))
        >>> sorted(out), out["action"].shape
        (['action'], torch.Size([3]))
    """

    in_keys = ("observation",)
    out_keys = ("action",)

    def __init__(
        self,
        spec: EnvSpec,
        encoder: str = "mlp",
        hidden: Sequence[int] = (128, 128),
        features: int = 512,
        activation: str = "relu",
        init_log_std: float = 0.0,
        obs_norm: bool = False,
        obs_clip: float = 10.0,
    ) -> None:
        """``init_log_std`` and ``obs_clip`` are accepted so every model config has the same keys."""
        super().__init__()
        if obs_norm:
            raise ValueError("model.obs_norm=true: observation normalisation is implemented for actor-critics "
                             "(trainer=ppo), not for Q-networks")
        if spec.action_kind != "discrete":
            raise ValueError("QNetwork needs a discrete action space (use trainer=ppo for continuous actions)")
        self.spec = spec
        act = _ACTIVATIONS[activation]
        if encoder == "mlp":
            in_dim = int(math.prod(spec.obs_shape)) if spec.obs_shape else 1
            hidden = tuple(hidden)
            self.shared: nn.Module | None = None
            self.head = nn.Sequential(mlp(in_dim, hidden, act), _layer_init(nn.Linear(hidden[-1], spec.action_n), 1.0))
        elif encoder == "nature_cnn":
            if len(spec.obs_shape) != 3:
                raise ValueError(f"nature_cnn needs [C, H, W] observations, got shape {spec.obs_shape}")
            self.shared = NatureCNN(spec.obs_shape[0], spec.obs_shape[1], features)
            self.head = _layer_init(nn.Linear(features, spec.action_n), 1.0)
        else:
            raise ValueError(f"unknown encoder {encoder!r} (allowed: mlp, nature_cnn)")
        self.register_buffer("epsilon", torch.ones(()))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = self.shared(obs) if self.shared is not None else obs.reshape(obs.shape[0], -1).float()
        return self.head(x)

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        q = self(inputs["observation"])
        greedy = q.argmax(-1)
        n = q.shape[0]
        explore = torch.rand(n, device=q.device) < self.epsilon
        if modes is not None:
            explore &= modes == int(InteractionMode.RANDOM)
        random = torch.randint(0, self.spec.action_n, (n,), device=q.device)
        return {"action": torch.where(explore, random, greedy)}


@dataclass(frozen=True)
class ModelSpec:
    """An import path plus keyword arguments: how to rebuild a model anywhere.

    Examples:
        >>> spec = ModelSpec("components.models.ActorCritic", {"hidden": [8]})
        >>> env = EnvSpec((4,), "float32", "discrete", action_n=2)
        >>> type(spec.build(env)).__name__
        'ActorCritic'
    """

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, env_spec: EnvSpec) -> nn.Module:
        module_name, _, attr = self.target.rpartition(".")
        factory = getattr(importlib.import_module(module_name), attr)
        return factory(env_spec, **self.kwargs)
