"""Action heads: how network outputs become actions, log-probabilities and entropies, one per action kind.

Each head has ``dim`` (outputs it needs from the actor), ``noise_width``
(uniforms per row it samples with), ``act(params, greedy, noise)`` (sample,
or the mode where ``greedy``) and ``evaluate(params, action)`` (log-prob and
entropy for the PPO loss). Log-probabilities of a factorised head are the
sum over its components, so PPO's ratio is the joint one.

Sampling is a deterministic function of the uniforms ``noise`` (``[rows,
noise_width]`` in (0, 1)): an env's own stream (see
:mod:`components.action_noise`) when the request carries it, else drawn
from torch's RNG. So the action a row gets never depends on the other rows
of its batch. Categoricals take the inverse CDF (one uniform per choice
made, whatever the number of actions), Gaussians Box-Muller.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from components.envs import EnvSpec


def row_uniforms(noise: torch.Tensor | None, like: torch.Tensor, width: int) -> torch.Tensor:
    """The row noise ``[rows, width]`` as ``like``'s dtype: the given one, or fresh draws from torch's RNG."""
    if noise is None:
        return torch.rand((like.shape[0], width), dtype=like.dtype, device=like.device)
    return noise.to(like.dtype).reshape(like.shape[0], width)


def inverse_cdf(log_probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from ``log_probs`` (last dim) by the uniforms ``u`` (one per distribution).

    ``u`` is scaled by the total mass (the float sum of the probabilities),
    so the index never runs past the last action and a zero-probability
    (masked) action is never the one whose interval holds the draw.
    """
    cdf = log_probs.exp().cumsum(-1)
    return (cdf < (u * cdf[..., -1]).unsqueeze(-1)).sum(-1)


def box_muller(u: torch.Tensor) -> torch.Tensor:
    """Standard normals from pairs of uniforms ``[rows, 2 * dim]`` -> ``[rows, dim]``."""
    first, second = u.chunk(2, dim=-1)
    return torch.sqrt(-2.0 * torch.log(first)) * torch.cos((2.0 * math.pi) * second)


class CategoricalHead(nn.Module):
    """Discrete actions: samples by the inverse CDF of one uniform, greedy is argmax."""

    noise_width = 1

    def __init__(self, n: int = 0) -> None:
        super().__init__()
        self.dim = n

    def act(self, logits: torch.Tensor, greedy: torch.Tensor | None,
            noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = F.log_softmax(logits, dim=-1)
        action = inverse_cdf(log_probs, row_uniforms(noise, logits, 1)[:, 0])
        if greedy is not None:
            action = torch.where(greedy, log_probs.argmax(-1), action)
        return action, log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1)

    def evaluate(self, logits: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = F.log_softmax(logits, dim=-1)
        log_prob = log_probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob, entropy


class MultiCategoricalHead(nn.Module):
    """MultiDiscrete actions: one independent categorical per component (the factorised policy of SB3 and RLlib).

    The components' logits lie side by side in one output vector; each is
    normalised on its own, padded to the widest so one ``log_softmax`` and one
    ``argmax`` serve them all.
    """

    def __init__(self, nvec: Sequence[int], shape: tuple[int, ...]) -> None:
        super().__init__()
        self.nvec, self.shape = tuple(int(n) for n in nvec), tuple(shape)
        self.dim = sum(self.nvec)
        self.noise_width = len(self.nvec)
        widest = max(self.nvec)
        index = torch.zeros(len(self.nvec), widest, dtype=torch.long)
        valid = torch.zeros(len(self.nvec), widest, dtype=torch.bool)
        start = 0
        for i, n in enumerate(self.nvec):
            index[i, :n] = torch.arange(start, start + n)
            valid[i, :n] = True
            start += n
        self.register_buffer("index", index, persistent=False)
        self.register_buffer("valid", valid, persistent=False)

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        padded = logits[:, self.index].masked_fill(~self.valid, float("-inf"))
        return F.log_softmax(padded, dim=-1)  # [rows, components, widest]

    def act(self, logits: torch.Tensor, greedy: torch.Tensor | None,
            noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = self._log_probs(logits)
        action = inverse_cdf(log_probs, row_uniforms(noise, logits, self.noise_width))
        if greedy is not None:
            action = torch.where(greedy.unsqueeze(-1), log_probs.argmax(-1), action)
        log_prob = log_probs.gather(-1, action.unsqueeze(-1)).squeeze(-1).sum(-1)
        return action.reshape(action.shape[0], *self.shape), log_prob

    def evaluate(self, logits: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = self._log_probs(logits)
        chosen = action.reshape(action.shape[0], -1).long().unsqueeze(-1)
        log_prob = log_probs.gather(-1, chosen).squeeze(-1).sum(-1)
        probs = log_probs.exp()
        entropy = -(probs * log_probs.masked_fill(~self.valid, 0.0)).sum((-1, -2))
        return log_prob, entropy


class BernoulliHead(nn.Module):
    """MultiBinary actions: one independent Bernoulli per flag; greedy takes each flag with p > 0.5."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)
        self.dim = self.noise_width = int(math.prod(self.shape))

    def act(self, logits: torch.Tensor, greedy: torch.Tensor | None,
            noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        action = row_uniforms(noise, logits, self.dim) < torch.sigmoid(logits)
        if greedy is not None:
            action = torch.where(greedy.unsqueeze(-1), logits > 0, action)
        log_prob = self._log_prob(logits, action.to(logits.dtype))
        return action.to(torch.int8).reshape(action.shape[0], *self.shape), log_prob

    @staticmethod
    def _log_prob(logits: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return -F.binary_cross_entropy_with_logits(logits, action, reduction="none").sum(-1)

    def evaluate(self, logits: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_prob = self._log_prob(logits, action.reshape(action.shape[0], -1).to(logits.dtype))
        p = torch.sigmoid(logits)
        entropy = (F.binary_cross_entropy_with_logits(logits, p, reduction="none")).sum(-1)
        return log_prob, entropy


class GaussianHead(nn.Module):
    """Continuous actions: a diagonal Gaussian, with a state-independent log-std unless one is given per row.

    Actions are sampled unbounded (the env block clips them to the action
    box), so the stored log-probability matches the sampled action exactly.
    ``log_std`` given to :meth:`act`/:meth:`evaluate` (``[rows, dim]``, a
    TensorDictModule's ``scale`` out_key) replaces the learned parameter.
    """

    def __init__(self, dim: int, init_log_std: float = 0.0, shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.dim, self.shape = dim, tuple(shape) if shape is not None else (dim,)
        self.noise_width = 2 * dim
        self.log_std = nn.Parameter(torch.full((dim,), init_log_std))

    def act(self, mean: torch.Tensor, greedy: torch.Tensor | None, log_std: torch.Tensor | None = None,
            noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        log_std = self.log_std if log_std is None else log_std
        action = mean + log_std.exp() * box_muller(row_uniforms(noise, mean, self.noise_width))
        if greedy is not None:
            action = torch.where(greedy.unsqueeze(-1), mean, action)
        return action.reshape(action.shape[0], *self.shape), self._log_prob(mean, action, log_std)

    @staticmethod
    def _log_prob(mean: torch.Tensor, action: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        var = (2 * log_std).exp()
        return (-((action - mean) ** 2) / (2 * var) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def evaluate(self, mean: torch.Tensor, action: torch.Tensor,
                 log_std: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        log_std = self.log_std if log_std is None else log_std
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + log_std).sum(-1).expand(mean.shape[0])
        return self._log_prob(mean, action.reshape(action.shape[0], -1), log_std), entropy


#: uniforms per row of :func:`epsilon_greedy`: whether to explore, and which action then
EPSILON_NOISE_WIDTH = 2


def epsilon_greedy(q: torch.Tensor, epsilon: torch.Tensor, modes: torch.Tensor | None,
                   mask: torch.Tensor | None, random_mode: int, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax of action values ``q``, or with probability ``epsilon`` (rows in ``random_mode`` only) a random action.

    The random action is uniform over the actions ``mask`` allows (all, without one). ``noise``: the rows'
    uniforms (see the module docstring), two per row.
    """
    greedy = q.argmax(-1)
    u = row_uniforms(noise, q, EPSILON_NOISE_WIDTH)
    explore = u[:, 0] < epsilon
    if modes is not None:
        explore &= modes == random_mode
    n = q.shape[-1]
    if mask is None:
        random = (u[:, 1] * n).long().clamp_(max=n - 1)
    else:
        allowed = mask.long()
        pick = (u[:, 1] * allowed.sum(-1)).long().unsqueeze(-1)  # the pick-th allowed action, counting from 0
        random = (allowed.cumsum(-1) <= pick).sum(-1).clamp_(max=n - 1)
    return torch.where(explore, random, greedy)


def head_for(spec: EnvSpec, init_log_std: float = 0.0) -> nn.Module:
    """The head of ``spec``'s action kind (its ``dim`` is the actor's output width)."""
    if spec.action_kind == "discrete":
        return CategoricalHead(spec.action_n)
    if spec.action_kind == "multi_discrete":
        return MultiCategoricalHead(spec.action_nvec, spec.action_shape)
    if spec.action_kind == "multi_binary":
        return BernoulliHead(spec.action_shape)
    return GaussianHead(int(math.prod(spec.action_shape)), init_log_std, spec.action_shape)
