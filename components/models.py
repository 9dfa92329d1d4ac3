"""Actor-critic networks and the action heads they act through.

Every served model implements one hot-path method, ``act(inputs, modes)``:
plain tensors in, a dict of tensors out, the interaction mode given per row.
Trainers use ``forward``/``evaluate``. Models are rebuilt from a
:class:`ModelSpec` (an import path and keyword arguments) inside an inference
process, so no module is ever pickled.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from components.envs import EnvSpec
from components.action_noise import NOISE_KEY
from components.heads import EPSILON_NOISE_WIDTH, BernoulliHead, CategoricalHead, GaussianHead, MultiCategoricalHead, \
    epsilon_greedy, head_for
from components.interaction import InteractionMode
from components.normalization import RunningNorm
from components.encoders import ACTIVATIONS as _ACTIVATIONS
from components.encoders import NatureCNN, mlp
from components.encoders import layer_init as _layer_init
from components.obs_input import ObservationInput, masked

__all__ = ["ActorCritic", "BernoulliHead", "CategoricalHead", "GaussianHead", "ModelSpec", "MultiCategoricalHead",
           "NatureCNN", "QNetwork", "mlp"]


def _greedy_rows(modes: torch.Tensor | None) -> torch.Tensor | None:
    # No "any greedy row?" shortcut: reading it back would synchronise with
    # the device and make the forward impossible to capture in a CUDA graph.
    if modes is None:
        return None
    return modes != int(InteractionMode.RANDOM)


def _feed_forward(name: str, rnn: str | None) -> None:
    if rnn is not None:
        raise ValueError(f"model.rnn={rnn}: {name} is feed-forward; a recurrent core is "
                         "components.recurrent.RecurrentActorCritic (trainer=ppo), which model.rnn selects")


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
        rnn: str | None = None,
        rnn_hidden: int = 128,
        rnn_layers: int = 1,
    ) -> None:
        """``rnn*``: every model config has them; a recurrent core is :class:`~components.recurrent.RecurrentActorCritic`."""
        super().__init__()
        _feed_forward(type(self).__name__, rnn)
        self.spec = spec
        act = _ACTIVATIONS[activation]
        #: running observation normalisation (part of the weights; see components.normalization)
        self.obs_norm: RunningNorm | None = None
        self.head: nn.Module = head_for(spec, init_log_std)
        action_dim = self.head.dim
        #: how observations become features (one-hot for categorical ones, a Dict/Tuple leaf by leaf, images
        #: by the Nature CNN): see components.obs_input
        self.inputs = ObservationInput(spec, features)
        if spec.is_tree and obs_norm:
            raise ValueError("model.obs_norm=true: Dict/Tuple observations are encoded leaf by leaf; normalising "
                             "them is not supported (normalise the vector leaves in the env)")
        if encoder == "mlp" or spec.is_tree:  # a tree's images have their CNN in the inputs
            in_dim = self.inputs.out_dim
            hidden = tuple(hidden)
            self.shared: nn.Module | None = None
            self.actor = nn.Sequential(mlp(in_dim, hidden, act), _layer_init(nn.Linear(hidden[-1], action_dim), 0.01))
            self.critic = nn.Sequential(mlp(in_dim, hidden, act), _layer_init(nn.Linear(hidden[-1], 1), 1.0))
            if obs_norm:
                if spec.categorical_obs:
                    raise ValueError("model.obs_norm=true: the observations are categories (one-hot encoded), "
                                     "there is nothing to normalise")
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
        x = self.inputs(obs)
        return x if self.obs_norm is None else self.obs_norm(x)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Distribution parameters (logits or mean) and state values."""
        x = self._features(obs)
        return masked(self.actor(x), self.inputs.mask(obs)), self.critic(x).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self._features(obs)).squeeze(-1)

    @property
    def action_noise_width(self) -> int:
        """Uniforms per row the head samples with (the env-side noise, see :mod:`components.action_noise`)."""
        return int(self.head.noise_width)

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        params, value = self(inputs["observation"])
        # the action comes in the action space's shape
        action, log_prob = self.head.act(params, _greedy_rows(modes), noise=inputs.get(NOISE_KEY))
        return {"action": action, "sample_log_prob": log_prob, "state_value": value}

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probability of ``action``, entropy and value, for the loss."""
        params, value = self(obs)
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
    #: uniforms per row of epsilon-greedy exploration (the env-side noise, see :mod:`components.action_noise`)
    action_noise_width = EPSILON_NOISE_WIDTH

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
        rnn: str | None = None,
        rnn_hidden: int = 128,
        rnn_layers: int = 1,
    ) -> None:
        """``init_log_std``, ``obs_clip`` and ``rnn*`` are accepted so every model config has the same keys."""
        super().__init__()
        _feed_forward(type(self).__name__, rnn)
        if obs_norm:
            raise ValueError("model.obs_norm=true: observation normalisation is implemented for actor-critics "
                             "(trainer=ppo), not for Q-networks")
        if spec.action_kind != "discrete":
            raise ValueError(f"QNetwork needs a Discrete action space, not {spec.action_kind} actions (use trainer=ppo)")
        self.spec = spec
        act = _ACTIVATIONS[activation]
        self.inputs = ObservationInput(spec, features)
        if encoder == "mlp" or spec.is_tree:  # a tree's images have their CNN in the inputs
            in_dim = self.inputs.out_dim
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
        """Action values; a masked action's is :data:`~components.obs_input.MASKED_LOGIT` (so a max skips it)."""
        x = self.shared(obs) if self.shared is not None else self.inputs(obs)
        return masked(self.head(x), self.inputs.mask(obs))

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        obs = inputs["observation"]
        action = epsilon_greedy(self(obs), self.epsilon, modes, self.inputs.mask(obs), int(InteractionMode.RANDOM),
                                inputs.get(NOISE_KEY))
        return {"action": action}


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
        """The model; a ``TensorDictModule`` the target returns is wrapped (:mod:`components.td_policy`)."""
        from components.td_policy import TensorDictPolicy, is_tensordict_module

        module_name, _, attr = self.target.rpartition(".")
        factory = getattr(importlib.import_module(module_name), attr)
        model = factory(env_spec, **self.kwargs)
        if is_tensordict_module(model):
            return TensorDictPolicy(model, env_spec, float(self.kwargs.get("init_log_std", 0.0)))
        return model
