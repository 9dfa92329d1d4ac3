"""Running statistics that normalise what a policy sees and what a learner is rewarded.

Observation normalisation lives *inside* the policy (:class:`RunningNorm`,
a module of :class:`~components.models.ActorCritic`): its mean and variance
are buffers, so they are part of the weights. The trainer updates them from
the batches it learns from, after its gradient step; they travel to the
inference server (thread, process, numpy engine) with the weights and the
policy version, and into the checkpoint with the model. So an action is
always computed with the statistics of the version that produced it, and a
trainer's first epoch evaluates the batch exactly as it was acted on.

Reward scaling (:class:`RewardScaler`) is the learner's business only:
rewards are divided by the running standard deviation of each env's
discounted return, as gymnasium's ``NormalizeReward`` (CleanRL's
``ppo_continuous_action``) does inside the env, here applied to the rows of
a batch in env-and-step order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn


def merge_moments(mean: np.ndarray, var: np.ndarray, count: float, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Chan et al.'s parallel update of a mean and (population) variance with a batch of rows."""
    b_mean, b_var, b_count = batch.mean(0), batch.var(0), batch.shape[0]
    total = count + b_count
    delta = b_mean - mean
    new_mean = mean + delta * (b_count / total)
    m2 = var * count + b_var * b_count + delta**2 * (count * b_count / total)
    return new_mean, m2 / total, total


class RunningNorm(nn.Module):
    """``clip((x - mean) / sqrt(var + eps))`` with running statistics kept as buffers.

    Until :meth:`update` sees data the statistics are mean 0, variance 1:
    the identity (then clipped).

    Examples:
        >>> norm = RunningNorm((2,))
        >>> norm.update(torch.tensor([[1.0, 10.0], [3.0, 30.0]]))
        >>> norm.mean.tolist(), [round(v, 3) for v in norm(torch.tensor([[3.0, 30.0]]))[0].tolist()]
        ([2.0, 20.0], [1.0, 1.0])
    """

    def __init__(self, shape: tuple[int, ...], clip: float = 10.0, eps: float = 1e-8) -> None:
        super().__init__()
        self.clip, self.eps = float(clip), float(eps)
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        # 1-element, not 0-d: every buffer travels through shared memory as an array
        self.register_buffer("count", torch.zeros(1, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch of rows (``[N, *shape]``) into the statistics."""
        rows = x.detach().reshape(x.shape[0], *self.mean.shape).double().cpu().numpy()
        if rows.shape[0] == 0:
            return
        mean, var, count = merge_moments(self.mean.cpu().numpy(), self.var.cpu().numpy(), float(self.count[0]), rows)
        self.mean.copy_(torch.from_numpy(mean))
        self.var.copy_(torch.from_numpy(var))
        self.count.fill_(count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = (self.var + self.eps).rsqrt().to(x.dtype)
        return ((x - self.mean.to(x.dtype)) * scale).clamp(-self.clip, self.clip)

    def numpy_params(self) -> tuple[np.ndarray, np.ndarray, float]:
        """``(mean, 1/std, clip)`` as float32 arrays, for the numpy serving engine."""
        mean = self.mean.detach().cpu().numpy().astype(np.float32)
        inv_std = (1.0 / np.sqrt(self.var.detach().cpu().numpy() + self.eps)).astype(np.float32)
        return mean, inv_std, self.clip

    def extra_repr(self) -> str:
        return f"shape={tuple(self.mean.shape)}, clip={self.clip:g}"


class RewardScaler:
    """Divides rewards by the running std of each env's discounted return (then clips).

    Rows must come ordered per env and step (as a PPO batch is after its
    sort). An env's return carries over from one batch to the next when its
    steps follow on; an episode end, or a gap in ``env_step`` (a restarted
    worker), starts it again.

    Examples:
        >>> scaler = RewardScaler(gamma=0.5)
        >>> r = scaler.scale(np.array([0, 0]), np.array([0, 1]), np.array([1.0, 1.0]), np.array([False, False]))
        >>> [round(v, 3) for v in r.tolist()]  # returns 1.0 and 1.5: std 0.25
        [4.0, 4.0]
    """

    def __init__(self, gamma: float, clip: float = 10.0, eps: float = 1e-8) -> None:
        self.gamma, self.clip, self.eps = float(gamma), float(clip), float(eps)
        self.mean, self.var, self.count = np.zeros(()), np.ones(()), 0.0
        self._returns: dict[int, float] = {}
        self._last_step: dict[int, int] = {}

    @property
    def std(self) -> float:
        return float(np.sqrt(self.var + self.eps))

    def scale(self, env: np.ndarray, step: np.ndarray, reward: np.ndarray, done: np.ndarray) -> np.ndarray:
        returns = np.empty(len(reward), np.float64)
        carried, last = self._returns, self._last_step
        for i, (e, s, r, d) in enumerate(zip(env.tolist(), step.tolist(), reward.tolist(), done.tolist())):
            previous = carried.get(e, 0.0) if last.get(e) == s - 1 else 0.0
            g = previous * self.gamma + r
            returns[i] = g
            carried[e] = 0.0 if d else g
            last[e] = s
        if len(returns):
            self.mean, self.var, self.count = merge_moments(self.mean, self.var, self.count, returns[:, None])
            self.mean, self.var = self.mean.reshape(()), self.var.reshape(())
        return np.clip(reward / self.std, -self.clip, self.clip)

    def state_dict(self) -> dict[str, Any]:
        envs = sorted(self._returns)
        return {
            "moments": torch.tensor([float(self.mean), float(self.var), self.count], dtype=torch.float64),
            "envs": torch.tensor(envs, dtype=torch.int64),
            "returns": torch.tensor([self._returns[e] for e in envs], dtype=torch.float64),
            "last_step": torch.tensor([self._last_step[e] for e in envs], dtype=torch.int64),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mean, var, count = (float(v) for v in state["moments"].tolist())
        self.mean, self.var, self.count = np.asarray(mean), np.asarray(var), count
        envs = state["envs"].tolist()
        self._returns = dict(zip(envs, state["returns"].tolist()))
        self._last_step = dict(zip(envs, state["last_step"].tolist()))
