"""Soft Actor-Critic from a replay buffer, read top to bottom like CleanRL's ``sac_continuous_action.py``.

One :meth:`SACTrainer.learn` is one gradient step of the twin critics on a
sampled batch (n-step soft targets from the target critics, the smaller of
the two), every ``policy_frequency`` steps that many actor steps (and, with
``autotune``, entropy-coefficient steps) on the same observations, and a
Polyak step of the target critics every ``target_update_period`` steps.

How many steps follow each collected batch is the update-to-data ratio:
every row written to the replay after ``learning_starts`` earns
``updates_per_frame`` steps, spent by the next :meth:`SACTrainer.update`.
That is the guarantee the overlapped loop needs
(:func:`pipeline.runner.loops.run_off_policy`): the collector keeps
stepping envs into replay while the learner updates, at most
``max_batches_ahead`` batches ahead, and after every call the learner has
taken exactly ``floor(updates_per_frame * rows)`` steps for the rows the
buffer had received when it was called, so it never falls behind the ratio
and never counts a row that is not in the buffer yet.

Only the actor is served (``model``); the critics stay with the learner.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from components.sac_models import TwinQ
from components.trainers.base import NonFiniteError, config_from
from components.trainers.settings import SACConfig




def _adam(params: Any, lr: float, eps: float) -> torch.optim.Adam:
    params = list(params)
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.Adam(params, lr=lr, eps=eps, fused=fused)


class SACTrainer:
    """Owns the actor (served), the twin critics and their targets, three optimisers and the entropy coefficient.

    Implements :class:`components.trainers.base.Trainer` (off-policy). The
    actor must provide ``act`` (served) and ``sample(obs) -> (action,
    log_prob)``, a reparameterised draw in the env's units
    (:class:`components.sac_models.SquashedGaussianActor` does).
    :attr:`policy_version` grows by one per :meth:`update`, as DQN's.
    """

    on_policy: ClassVar[bool] = False

    def __init__(self, model: nn.Module, config: SACConfig | None = None, *, device: str = "cpu",
                 policy_version: int = 0, env_spec: Any = None, **hyper: Any) -> None:
        config = config_from(SACConfig, config, hyper, "SACTrainer")
        self.config = config
        self.device = torch.device(device)
        self.model = model.to(self.device)
        spec = env_spec if env_spec is not None else getattr(model, "spec", None)
        if spec is None:
            raise ValueError("SACTrainer: the actor has no .spec; pass env_spec= (the critics are built from it)")
        self.critic = TwinQ(spec, config.critic_hidden, config.critic_activation).to(self.device)
        self.critic_target = copy.deepcopy(self.critic).eval()
        for p in self.critic_target.parameters():
            p.requires_grad_(False)
        self.actor_params = [p for p in self.model.parameters() if p.requires_grad]
        self.critic_params = list(self.critic.parameters())
        self.actor_optimizer = _adam(self.actor_params, config.actor_lr, config.adam_eps)
        self.critic_optimizer = _adam(self.critic_params, config.critic_lr, config.adam_eps)
        action_dim = int(math.prod(spec.action_shape))
        self.target_entropy = -float(action_dim) if config.target_entropy is None else float(config.target_entropy)
        self.log_alpha = torch.tensor(math.log(config.alpha), device=self.device, requires_grad=config.autotune)
        self.alpha_optimizer = _adam([self.log_alpha], config.alpha_lr, config.adam_eps) if config.autotune else None
        self.updates = 0
        self._version = int(policy_version)
        self.frames = 0
        #: update-to-data bookkeeping: replay rows accounted for, and steps earned but not taken (< 1)
        self.rows_seen = 0
        self.credit = 0.0

    @property
    def policy_version(self) -> int:
        """Calls of :meth:`update` so far: the version of :attr:`model` (0 = initial)."""
        return self._version

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.detach().exp()

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "critic": self.critic.state_dict(),
                "critic_target": self.critic_target.state_dict(),
                "actor_optimizer": self.actor_optimizer.state_dict(),
                "critic_optimizer": self.critic_optimizer.state_dict(),
                "alpha_optimizer": self.alpha_optimizer.state_dict() if self.alpha_optimizer is not None else None,
                "log_alpha": self.log_alpha.detach().clone(), "updates": self.updates,
                "policy_version": self._version, "frames": self.frames, "rows_seen": self.rows_seen,
                "credit": self.credit}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        if self.alpha_optimizer is not None and state.get("alpha_optimizer") is not None:
            self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.updates, self._version, self.frames = (int(state["updates"]), int(state["policy_version"]),
                                                    int(state["frames"]))
        self.rows_seen, self.credit = int(state["rows_seen"]), float(state["credit"])

    # -- the update-to-data ratio ------------------------------------------------------------------
    def steps_due(self, written: int, size: int) -> int:
        """Gradient steps earned by the rows written since the last call (``written`` ever, ``size`` kept).

        Rows count once the buffer holds ``learning_starts`` (and a batch);
        the rows of the batch that crossed it count from there. A resumed
        run whose replay was not saved refills to ``learning_starts`` first
        and owes nothing for the refill.
        """
        cfg = self.config
        new = max(0, written - self.rows_seen)
        self.rows_seen = written
        if size < max(cfg.learning_starts, cfg.batch_size):
            return 0
        self.credit += cfg.updates_per_frame * min(new, size - cfg.learning_starts + 1)
        steps = int(self.credit)
        self.credit -= steps
        return steps

    def update(self, buffer: Any, *, frames: int) -> dict[str, float]:
        """Take the gradient steps the rows written since the last call earned; one version more.

        Returns the mean metrics of the steps, ``alpha``, and ``updates`` (steps so far).
        """
        cfg = self.config
        steps = self.steps_due(int(buffer.written), len(buffer))
        metrics: dict[str, float] = {}
        if steps:
            prioritized = getattr(buffer, "sampler", "uniform") == "prioritized"
            sums: dict[str, torch.Tensor] = {}
            counts: dict[str, int] = defaultdict(int)
            for _ in range(steps):
                sample = buffer.sample(cfg.batch_size, policy_version=self._version)
                row, td_abs = self.learn(sample)
                if prioritized:
                    buffer.update_priorities(sample["index"], td_abs.cpu())
                for key, value in row.items():  # the actor's keys only on the steps that updated it
                    sums[key] = sums[key] + value if key in sums else value
                    counts[key] += 1
            metrics = {key: float(total) / counts[key] for key, total in sums.items()}
            metrics["steps_per_batch"] = float(steps)
        self.frames = frames
        metrics["alpha"] = float(self.alpha)
        metrics["updates"] = float(self.updates)
        self._version += 1
        return metrics

    # -- the losses --------------------------------------------------------------------------------
    def critic_loss(self, sample: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both critics' (importance-weighted) squared errors against the soft n-step target, summed.

        Returns the loss, the critics' values ``[2, rows]`` and |TD error| per row (the larger critic's).
        """
        cfg, dev = self.config, self.device
        obs = sample["observation"].to(dev)
        action = sample["action"].to(dev)
        reward = sample["next", "reward"].to(dev).float()
        next_obs = sample["next", "observation"].to(dev)
        terminated = sample["next", "terminated"].to(dev).float()
        steps = sample.get(("next", "n_steps"), None)
        discount = cfg.gamma ** (steps.to(dev).float() if steps is not None else torch.ones_like(reward))
        weight = sample.get("weight", None)
        with torch.no_grad():
            next_action, next_log_pi = self.model.sample(next_obs)
            next_q = self.critic_target(next_obs, next_action).min(0).values - self.alpha * next_log_pi
            target = reward + discount * (1.0 - terminated) * next_q
        q = self.critic(obs, action)
        td = target - q
        squared = td.pow(2)
        if weight is not None:
            squared = squared * weight.to(dev).float()
        return squared.mean(-1).sum(), q.detach(), td.detach().abs().max(0).values

    def actor_loss(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``alpha * log pi(a|s) - min Q(s, a)`` for reparameterised actions; returns it and the log-probs."""
        action, log_pi = self.model.sample(obs)
        q = self.critic(obs, action).min(0).values
        return (self.alpha * log_pi - q).mean(), log_pi.detach()

    def alpha_loss(self, log_pi: torch.Tensor) -> torch.Tensor:
        """Moves ``log_alpha`` up while the policy's entropy (``-log_pi``) is below the target, down above it."""
        return (-self.log_alpha.exp() * (log_pi + self.target_entropy)).mean()

    # -- one step ----------------------------------------------------------------------------------
    def _step(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], loss: torch.Tensor,
              where: str) -> None:
        if not bool(torch.isfinite(loss)):
            raise NonFiniteError(f"SAC {where} at gradient step {self.updates + 1}: non-finite loss {float(loss)}; "
                                 "the weights were not updated (check the learning rates and the env's rewards)")
        # gradients of these parameters only: the actor's loss reads the critics, whose gradients nobody needs
        grads = torch.autograd.grad(loss, params)
        for p, g in zip(params, grads):
            p.grad = g
        if self.config.max_grad_norm is not None:
            norm = nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
            if not bool(torch.isfinite(norm)):
                raise NonFiniteError(f"SAC {where} at gradient step {self.updates + 1}: non-finite gradient norm")
        optimizer.step()

    def learn(self, sample: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """One critic step on ``sample`` (and the actor/alpha/target steps due); metrics and |TD error| per row."""
        cfg = self.config
        q_loss, q, td_abs = self.critic_loss(sample)
        self._step(self.critic_optimizer, self.critic_params, q_loss, "critic loss")
        self.updates += 1
        metrics = {"q_loss": q_loss.detach(), "q_mean": q.mean()}
        if self.updates % cfg.policy_frequency == 0:
            obs = sample["observation"].to(self.device)
            for _ in range(cfg.policy_frequency):
                actor_loss, log_pi = self.actor_loss(obs)
                self._step(self.actor_optimizer, self.actor_params, actor_loss, "actor loss")
                if self.alpha_optimizer is not None:
                    self._step(self.alpha_optimizer, [self.log_alpha], self.alpha_loss(log_pi), "alpha loss")
            metrics.update(actor_loss=actor_loss.detach(), entropy=-log_pi.mean())
        if self.updates % cfg.target_update_period == 0:
            self.update_targets()
        return metrics, td_abs

    def update_targets(self) -> None:
        """``target += tau * (online - target)`` for every critic parameter (tau = 1: a copy)."""
        with torch.no_grad():
            targets, online = list(self.critic_target.parameters()), list(self.critic.parameters())
            if self.config.tau >= 1.0:
                torch._foreach_copy_(targets, online)
            else:
                torch._foreach_lerp_(targets, online, self.config.tau)

