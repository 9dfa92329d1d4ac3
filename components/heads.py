"""Action heads: how network outputs become actions, log-probabilities and entropies, one per action kind.

Each head has ``dim`` (outputs it needs from the actor), ``act(params,
greedy)`` (sample, or the mode where ``greedy``) and ``evaluate(params,
action)`` (log-prob and entropy for the PPO loss). Log-probabilities of a
factorised head are the sum over its components, so PPO's ratio is the
joint one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from components.envs import EnvSpec


def _gumbel_argmax(log_probs: torch.Tensor) -> torch.Tensor:
    noise = torch.rand_like(log_probs).clamp_(min=1e-20).log_().neg_().log_()
    return (log_probs - noise).argmax(-1)


class CategoricalHead(nn.Module):
    """Discrete actions: samples with the Gumbel-max trick, greedy is argmax."""

    def __init__(self, n: int = 0) -> None:
        super().__init__()
        self.dim = n

    def act(self, logits: torch.Tensor, greedy: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = F.log_softmax(logits, dim=-1)
        action = _gumbel_argmax(log_probs)
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

    def act(self, logits: torch.Tensor, greedy: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = self._log_probs(logits)
        action = _gumbel_argmax(log_probs)
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
        self.dim = int(math.prod(self.shape))

    def act(self, logits: torch.Tensor, greedy: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        action = torch.rand_like(logits) < torch.sigmoid(logits)
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
        self.log_std = nn.Parameter(torch.full((dim,), init_log_std))

    def act(self, mean: torch.Tensor, greedy: torch.Tensor | None,
            log_std: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        log_std = self.log_std if log_std is None else log_std
        action = mean + log_std.exp() * torch.randn_like(mean)
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


def epsilon_greedy(q: torch.Tensor, epsilon: torch.Tensor, modes: torch.Tensor | None,
                   mask: torch.Tensor | None, random_mode: int) -> torch.Tensor:
    """Argmax of action values ``q``, or with probability ``epsilon`` (rows in ``random_mode`` only) a random action.

    The random action is uniform over the actions ``mask`` allows (all, without one).
    """
    greedy = q.argmax(-1)
    n = q.shape[0]
    explore = torch.rand(n, device=q.device) < epsilon
    if modes is not None:
        explore &= modes == random_mode
    if mask is None:
        random = torch.randint(0, q.shape[-1], (n,), device=q.device)
    else:
        random = (torch.rand(q.shape, device=q.device) * mask).argmax(-1)
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
