"""SAC's networks: a tanh-squashed Gaussian actor (what the server serves) and twin Q critics (the learner's own).

The actor is the whole served model: the critics never leave the learner,
so a weights push carries a third of SAC's parameters. Actions come out in
the env's units (``tanh`` scaled onto the action box), so the replay holds
what the env executed and the critics read the same units (as in CleanRL's
``sac_continuous_action.py``).

The twin critics are one module with stacked weights: one batched matmul
per layer computes both Q-values, where two ``nn.Linear`` stacks would
launch twice the ops for the same arithmetic. They are initialised like
``nn.Linear`` (uniform in ``1/sqrt(fan_in)``), each critic from its own draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from components.action_noise import NOISE_KEY
from components.encoders import ACTIVATIONS
from components.envs import EnvSpec
from components.heads import box_muller, row_uniforms
from components.interaction import InteractionMode
from components.obs_input import ObservationInput

#: CleanRL's bounds of the actor's log standard deviation (``LOG_STD_MIN``, ``LOG_STD_MAX``)
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


def action_box(spec: EnvSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, bias)`` mapping ``tanh``'s (-1, 1) onto the action box; one line if the box is unbounded."""
    if spec.action_kind != "continuous":
        raise ValueError(f"SAC needs a continuous (Box) action space, not {spec.action_kind} actions "
                         "(use trainer=dqn or trainer=ppo)")
    low = torch.tensor(spec.action_low, dtype=torch.float32)
    high = torch.tensor(spec.action_high, dtype=torch.float32)
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
        raise ValueError(f"SAC squashes actions into the action box, which must be bounded (low {list(spec.action_low)}"
                         f", high {list(spec.action_high)}); wrap the env to rescale its actions")
    return (high - low) / 2.0, (high + low) / 2.0


def _check_encoder(name: str, encoder: str, obs_norm: bool, rnn: str | None) -> None:
    if encoder != "mlp":
        raise ValueError(f"model.encoder={encoder!r}: {name} encodes vector (or Dict/Tuple) observations with an MLP; "
                         "SAC from pixels is not supported")
    if obs_norm:
        raise ValueError("model.obs_norm=true: observation normalisation is implemented for PPO's actor-critics, "
                         "not for SAC")
    if rnn is not None:
        raise ValueError(f"model.rnn={rnn}: a recurrent model is trained by trainer=ppo only (SAC is feed-forward)")


class SquashedGaussianActor(nn.Module):
    """``tanh(mean + std * noise)`` scaled onto the action box; greedy rows act ``tanh(mean)`` scaled.

    :meth:`act` is the served hot path (no gradient, actions only);
    :meth:`sample` is the learner's reparameterised draw with its
    log-probability, corrected for the squashing (the ``log(1 - tanh^2)``
    term of the SAC paper's appendix C).

    Examples:
        >>> spec = EnvSpec((3,), "float32", "continuous", action_shape=(1,), action_low=(-2.0,), action_high=(2.0,))
        >>> actor = SquashedGaussianActor(spec, hidden=(8,))
        >>> out = actor.act({"observation": torch.zeros(4, 3)}, torch.zeros(4, dtype=torch.int8))
        >>> out["action"].shape, bool(out["action"].abs().max() <= 2.0)
        (torch.Size([4, 1]), True)
    """

    in_keys = ("observation",)
    out_keys = ("action",)

    def __init__(self, spec: EnvSpec, encoder: str = "mlp", hidden: Sequence[int] = (256, 256), features: int = 512,
                 activation: str = "relu", init_log_std: float = 0.0, obs_norm: bool = False, obs_clip: float = 10.0,
                 rnn: str | None = None, rnn_hidden: int = 128, rnn_layers: int = 1) -> None:
        """``init_log_std``, ``obs_clip``, ``rnn_*``: accepted so every model config has the same keys."""
        super().__init__()
        _check_encoder(type(self).__name__, encoder, obs_norm, rnn)
        self.spec = spec
        scale, bias = action_box(spec)
        self.register_buffer("action_scale", scale)
        self.register_buffer("action_bias", bias)
        self.dim = int(math.prod(spec.action_shape))
        self.inputs = ObservationInput(spec, features)
        hidden = tuple(hidden)
        layers: list[nn.Module] = []
        width = self.inputs.out_dim
        for out in hidden:  # nn.Linear's own initialisation, as CleanRL's SAC has it
            layers += [nn.Linear(width, out), ACTIVATIONS[activation]()]
            width = out
        self.trunk = nn.Sequential(*layers)
        self.mean = nn.Linear(hidden[-1], self.dim)
        self.log_std = nn.Linear(hidden[-1], self.dim)

    @property
    def action_noise_width(self) -> int:
        """Uniforms per row (Box-Muller pairs): the env-side noise of :mod:`components.action_noise`."""
        return 2 * self.dim

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-squash mean and the log-std, squashed into ``[LOG_STD_MIN, LOG_STD_MAX]`` (CleanRL's way)."""
        x = self.trunk(self.inputs(obs))
        log_std = torch.tanh(self.log_std(x))
        return self.mean(x), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1.0)

    def _squash(self, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(z) * self.action_scale + self.action_bias

    def sample(self, obs: torch.Tensor, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised action in the env's units and its log-probability (``[rows, *shape]``, ``[rows]``).

        ``noise``: standard normals ``[rows, dim]`` (fresh ones from torch's RNG when None).
        """
        mean, log_std = self(obs)
        std = log_std.exp()
        eps = torch.randn_like(mean) if noise is None else noise.to(mean.dtype)
        z = mean + std * eps
        y = torch.tanh(z)
        log_prob = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        log_prob = log_prob - torch.log(self.action_scale * (1.0 - y.pow(2)) + 1e-6).sum(-1)
        action = y * self.action_scale + self.action_bias
        return action.reshape(action.shape[0], *self.spec.action_shape), log_prob

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        mean, log_std = self(inputs["observation"])
        z = mean + log_std.exp() * box_muller(row_uniforms(inputs.get(NOISE_KEY), mean, 2 * self.dim))
        if modes is not None:
            z = torch.where((modes != int(InteractionMode.RANDOM)).unsqueeze(-1), mean, z)
        action = self._squash(z)
        return {"action": action.reshape(action.shape[0], *self.spec.action_shape)}


class TwinQ(nn.Module):
    """``critics`` Q-functions ``Q(obs, action)`` evaluated together: ``[critics, rows]``.

    Examples:
        >>> spec = EnvSpec((3,), "float32", "continuous", action_shape=(1,), action_low=(-2.0,), action_high=(2.0,))
        >>> TwinQ(spec, hidden=(8,))(torch.zeros(5, 3), torch.zeros(5, 1)).shape
        torch.Size([2, 5])
    """

    def __init__(self, spec: EnvSpec, hidden: Sequence[int] = (256, 256), activation: str = "relu",
                 critics: int = 2, features: int = 512) -> None:
        super().__init__()
        self.inputs = ObservationInput(spec, features)
        self.action_dim = int(math.prod(spec.action_shape))
        dims = [self.inputs.out_dim + self.action_dim, *(int(h) for h in hidden), 1]
        self.critics = int(critics)
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for fan_in, fan_out in zip(dims[:-1], dims[1:]):
            bound = 1.0 / math.sqrt(fan_in)
            self.weights.append(nn.Parameter(torch.empty(self.critics, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(self.critics, 1, fan_out).uniform_(-bound, bound)))
        self.activation = ACTIVATIONS[activation]()

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.inputs(obs), action.reshape(action.shape[0], -1).to(torch.float32)], dim=-1)
        h = x.unsqueeze(0).expand(self.critics, *x.shape)
        last = len(self.weights) - 1
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            h = torch.baddbmm(bias, h, weight)
            if i < last:
                h = self.activation(h)
        return h.squeeze(-1)
