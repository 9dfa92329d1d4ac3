"""Double DQN from a replay buffer, read top to bottom like CleanRL's ``dqn.py``.

One :meth:`DQNTrainer.learn` is one gradient step on a sampled batch:
n-step targets from the target network (the online network picks the next
action, the target network values it), a Huber loss weighted by the
replay's importance weights, and the absolute TD errors returned as new
priorities. One :meth:`DQNTrainer.update` is what follows each collected
batch: ``updates_per_batch`` such steps on samples from the replay buffer,
then the exploration rate for the frames collected so far. The exploration
rate lives in the network (a buffer), so it reaches the inference server
together with the weights, under the next policy version.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from components.trainers.base import check_finite, config_from
from components.trainers.settings import DQNConfig




class DQNTrainer:
    """Owns the online and target Q-networks and the optimiser.

    Implements :class:`components.trainers.base.Trainer` (off-policy).
    :attr:`policy_version` is 0 for the initial weights and grows by one per
    :meth:`update`, since every update changes the pushed network (its
    weights or at least its exploration rate). The replay's policy-age filter
    compares stored versions against it.

    ``config`` or the hyper-parameters as keywords (``DQNTrainer(model, lr=1e-3)``,
    how Hydra builds it from the trainer node), not both.
    """

    on_policy: ClassVar[bool] = False

    def __init__(self, model: nn.Module, config: DQNConfig | None = None, *, device: str = "cpu",
                 policy_version: int = 0, **hyper: Any) -> None:
        config = config_from(DQNConfig, config, hyper, "DQNTrainer")
        self.config = config
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.target = copy.deepcopy(self.model).eval()
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr, eps=config.adam_eps, fused=True)
        # clipped every step and paired with the target's at each refresh: listed once, not walked each time
        self._params, self._target_params = list(self.model.parameters()), list(self.target.parameters())
        self.updates = 0
        self._version = int(policy_version)  # the label of the initial weights (0 unless resumed)
        self.frames = 0
        self.set_exploration(0)

    @property
    def policy_version(self) -> int:
        """Calls of :meth:`update` so far: the version of :attr:`model` (0 = initial)."""
        return self._version

    def epsilon_at(self, frames: int) -> float:
        """Linear decay from ``eps_start`` to ``eps_end`` over ``eps_fraction`` of the budget."""
        cfg = self.config
        span = max(1.0, cfg.eps_fraction * cfg.total_frames)
        return cfg.eps_end + (cfg.eps_start - cfg.eps_end) * max(0.0, 1.0 - frames / span)

    def set_exploration(self, frames: int) -> float:
        """Write the exploration rate for ``frames`` into the network (pushed with the weights)."""
        self.frames = frames
        eps = self.epsilon_at(frames)
        with torch.no_grad():
            self.model.epsilon.fill_(eps)
        return eps

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "target": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict(), "updates": self.updates,
                "policy_version": self._version, "frames": self.frames}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates, self._version, self.frames = (int(state["updates"]), int(state["policy_version"]),
                                                    int(state["frames"]))

    def update(self, buffer: Any, *, frames: int) -> dict[str, float]:
        """Learn after one collected batch; ``frames`` collected so far set the exploration rate.

        Once the buffer holds ``learning_starts`` transitions: ``updates_per_batch``
        calls of :meth:`learn`, each on a sample the buffer's policy-age filter
        admits for the current version, feeding |TD error| back as priorities
        when the buffer is prioritized. Always: the new exploration rate and
        one version more (the runner pushes the network after every call).
        Returns the mean metrics of the steps plus ``epsilon``.
        """
        cfg = self.config
        metrics: dict[str, float] = {}
        if len(buffer) >= cfg.learning_starts:
            prioritized = getattr(buffer, "sampler", "uniform") == "prioritized"
            sums: dict[str, float] = defaultdict(float)
            for _ in range(cfg.updates_per_batch):
                sample = buffer.sample(cfg.batch_size, policy_version=self._version)
                row, td_abs = self.learn(sample)
                if prioritized:
                    buffer.update_priorities(sample["index"], td_abs)
                for key, value in row.items():
                    sums[key] += value
            metrics = {key: total / cfg.updates_per_batch for key, total in sums.items()}
        metrics["epsilon"] = self.set_exploration(frames)
        self._version += 1
        return metrics

    def learn(self, sample: Any) -> tuple[dict[str, float], torch.Tensor]:
        """One gradient step on ``sample``; returns metrics and |TD error| per sample (new priorities)."""
        cfg = self.config
        dev = self.device
        obs = sample["observation"].to(dev)
        action = sample["action"].to(dev).long()
        reward = sample["next", "reward"].to(dev).float()
        next_obs = sample["next", "observation"].to(dev)
        terminated = sample["next", "terminated"].to(dev).float()
        steps = sample.get(("next", "n_steps"), None)
        discount = cfg.gamma ** (steps.to(dev).float() if steps is not None else torch.ones_like(reward))
        weight = sample.get("weight", None)
        weight = weight.to(dev).float() if weight is not None else torch.ones_like(reward)

        n = obs.shape[0]
        if cfg.double:
            # One online pass over obs and next_obs together: the next half
            # only picks the bootstrap action, so it is detached.
            both = self.model(torch.cat([obs, next_obs]))
            q_all, best = both[:n], both[n:].detach().argmax(-1, keepdim=True)
        else:
            q_all, best = self.model(obs), None
        with torch.no_grad():
            next_target = self.target(next_obs)
            if best is None:
                best = next_target.argmax(-1, keepdim=True)
            next_value = next_target.gather(-1, best).squeeze(-1)
            target = reward + discount * (1.0 - terminated) * next_value
        q = q_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)
        td = target - q
        loss = (weight * F.huber_loss(q, target, reduction="none", delta=cfg.huber_delta)).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self._params, cfg.max_grad_norm)
        check_finite(grad_norm, loss, f"DQN gradient step {self.updates + 1}")
        self.optimizer.step()
        self.updates += 1
        if self.updates % cfg.target_update_period == 0:
            self._update_target()
        td_abs = td.detach().abs()
        metrics = {
            "loss": float(loss.detach()),
            "q_mean": float(q.detach().mean()),
            "td_abs_mean": float(td_abs.mean()),
            "grad_norm": float(grad_norm),
        }
        return metrics, td_abs.cpu()

    def _update_target(self) -> None:
        tau = self.config.tau
        with torch.no_grad():
            for target, online in zip(self._target_params, self._params):
                if tau >= 1.0:
                    target.copy_(online)
                else:
                    target.lerp_(online, tau)
