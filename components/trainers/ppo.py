"""Proximal Policy Optimisation on batches from an asynchronous collector.

Reads top to bottom like CleanRL's ``ppo.py``, with two differences that
asynchronous collection needs:

* the batch is a set of transitions from many envs, possibly produced by a
  few successive policy versions. Transitions more than ``max_policy_lag``
  versions old are dropped; the rest are ordered per env (``env_index``,
  ``env_step``) to compute GAE.
* the importance ratio uses the behaviour log-probabilities and the GAE uses
  the behaviour values the inference server returned with each action, so
  no extra forward pass over the batch is needed. Only where a trajectory
  is cut (a time-limit truncation, or the end of an env's run inside this
  batch) is the successor's value computed, with the current network.

Policy lag is exact: the trainer owns the version (see
:mod:`components.trainers.base`), starting at 0 for the initial weights, so a
transition stamped with version ``v`` has lag ``policy_version - v``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from components.normalization import RewardScaler
from components.recurrent_state import state_leaves
from components.successors import successor_observations
from components.trainers.base import check_finite, config_from
from components.trainers.settings import PPOConfig
from components.trainers.sequences import split_sequences




def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    next_values: np.ndarray,
    terminated: np.ndarray,
    continues: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """Generalised advantage estimates over rows ordered per env and step.

    ``continues[i]`` says row ``i + 1`` is the same episode's next step, so
    the advantage recursion flows through it; elsewhere the chain is cut and
    ``next_values[i]`` (zero where terminated) bootstraps it.

    Examples:
        >>> adv = gae(np.ones(2), np.zeros(2), np.zeros(2), np.array([False, True]),
        ...           np.array([True, False]), gamma=1.0, lam=1.0)
        >>> adv.tolist()
        [2.0, 1.0]
    """
    deltas = rewards + gamma * next_values * ~terminated - values
    carry = (gamma * lam) * continues
    adv = np.zeros_like(deltas)
    running = 0.0
    for i in range(len(deltas) - 1, -1, -1):
        running = deltas[i] + carry[i] * running
        adv[i] = running
    return adv


class PPOTrainer:
    """Owns the learner's model and optimiser; one :meth:`update` per collected batch.

    Implements :class:`components.trainers.base.Trainer` (on-policy).
    :attr:`policy_version` is 0 for the initial weights and grows by one with
    every update that changes them; the runner pushes the weights with that
    version, so the server stamps it on the actions they produce.

    ``config`` or the hyper-parameters as keywords (``PPOTrainer(model, lr=1e-3)``,
    how Hydra builds it from the trainer node), not both.
    """

    on_policy: ClassVar[bool] = True
    #: successors are read only where a trajectory is cut (:func:`successor_observations`)
    dense_successors: ClassVar[bool] = False

    def __init__(self, model: nn.Module, config: PPOConfig | None = None, *, device: str = "cpu",
                 policy_version: int = 0, **hyper: Any) -> None:
        config = config_from(PPOConfig, config, hyper, "PPOTrainer")
        self.model = model.to(device)
        self.config = config
        self.device = torch.device(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr, eps=config.adam_eps, fused=True)
        # clipped every step, as SAC's: listed once, not walked through the module tree each time (13 us a step)
        self._params = list(self.model.parameters())
        self._version = int(policy_version)  # the label of the initial weights (0 unless resumed)
        self.frames = 0
        self.reward_scaler = RewardScaler(config.gamma) if config.reward_scale else None

    @property
    def policy_version(self) -> int:
        """Updates applied so far: the version of :attr:`model`'s weights (0 = initial)."""
        return self._version

    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "policy_version": self._version, "frames": self.frames}
        if self.reward_scaler is not None:
            state["reward_scaler"] = self.reward_scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._version, self.frames = int(state["policy_version"]), int(state["frames"])
        if self.reward_scaler is not None and "reward_scaler" in state:
            self.reward_scaler.load_state_dict(state["reward_scaler"])

    def _advantages(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        env = batch["env_index"].numpy()
        step = batch["env_step"].numpy()
        terminated = batch["next", "terminated"].numpy()
        truncated = batch["next", "truncated"].numpy()
        values = batch["state_value"].numpy().astype(np.float64)
        follows = np.zeros(len(env), bool)
        follows[:-1] = (env[1:] == env[:-1]) & (step[1:] == step[:-1] + 1)
        done = terminated | truncated
        continues = follows & ~done
        next_values = np.zeros_like(values)
        next_values[:-1] = values[1:]
        # Cut trajectories need the successor's value: truncated episodes and
        # each env's last transition in this batch.
        cut = ~terminated & (truncated | ~follows)
        if cut.any():
            with torch.no_grad():
                idx = torch.from_numpy(np.flatnonzero(cut))
                obs = successor_observations(batch, idx).to(self.device)
                leaves = state_leaves(self.model)
                if leaves:  # a recurrent model bootstraps from the state after the cut step (the response's)
                    state = {k: batch["next", k][idx].to(self.device) for k in leaves}
                    next_values[cut] = self.model.value(obs, state).double().cpu().numpy()
                else:
                    next_values[cut] = self.model.value(obs).double().cpu().numpy()
        rewards = batch["next", "reward"].numpy().astype(np.float64)
        if self.reward_scaler is not None:
            rewards = self.reward_scaler.scale(env, step, rewards, done)
        adv = gae(rewards, values, next_values, terminated, continues, cfg.gamma, cfg.gae_lambda)
        adv_t = torch.from_numpy(adv).float()
        return adv_t, adv_t + torch.from_numpy(values).float()

    def update(self, batch: Any, *, frames: int) -> dict[str, float]:
        """One PPO update on ``batch``, from loss to optimiser step; returns training metrics.

        ``frames`` is the number collected so far, this batch included; the
        learning rate anneals over the frames collected before it, as in
        CleanRL. Rows more than ``max_policy_lag`` versions old are dropped
        first. The version grows by one if the weights were updated (not when
        fewer than two rows are left).
        """
        cfg = self.config
        progress = max(0, frames - batch.numel()) / cfg.total_frames if cfg.total_frames > 0 else 0.0
        self.frames = frames
        lag = self._version - batch["policy_version"]
        keep = lag <= cfg.max_policy_lag
        metrics: dict[str, float] = {
            "policy_lag_mean": float(lag.float().mean()),
            "policy_lag_max": float(lag.max()),
            "dropped_stale_frames": float((~keep).sum()),
        }
        if not bool(keep.all()):
            batch = batch[keep]
        if batch.numel() < 2:
            return metrics
        order = torch.from_numpy(np.lexsort((batch["env_step"].numpy(), batch["env_index"].numpy())))
        batch = batch[order]
        advantages, returns = self._advantages(batch)

        if cfg.anneal_lr:
            lr = cfg.lr * max(0.0, 1.0 - progress)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        obs = batch["observation"].to(self.device)
        actions = batch["action"].to(self.device)
        old_log_probs = batch["sample_log_prob"].to(self.device)
        old_values = batch["state_value"].to(self.device)
        advantages, returns = advantages.to(self.device), returns.to(self.device)

        n = batch.numel()
        leaves = state_leaves(self.model)
        if leaves:  # a recurrent model: minibatches of whole sequences, each from its recorded initial state
            seqs = split_sequences(batch["env_index"].numpy(), batch["env_step"].numpy(),
                                   batch["next", "done"].numpy(), cfg.seq_len)
            places = seqs.mask.to(self.device)
            starts = {k: batch[k][seqs.starts].to(self.device) for k in leaves}
            per_place = [seqs.gather(x.cpu()).to(self.device)
                         for x in (obs, actions, old_log_probs, old_values, advantages, returns)]
            units = seqs.count
        else:
            units = n
        mb_size = max(1, units // cfg.minibatches)
        clip_fracs, approx_kls = [], []
        pg_loss = v_loss = entropy_loss = torch.zeros(())
        grad_norm = torch.zeros(())
        for _ in range(cfg.epochs):
            perm = torch.randperm(units, device=self.device)
            for start in range(0, units - mb_size + 1, mb_size):
                mb = perm[start : start + mb_size]
                if leaves:
                    s_obs, s_act, s_lp, s_val, s_adv, s_ret = (x[mb] for x in per_place)
                    real = places[mb]
                    log_prob, entropy, value = (x[real] for x in self.model.evaluate_sequences(
                        s_obs, s_act, {k: v[mb] for k, v in starts.items()}))
                    mb_old_lp, mb_old_v, mb_adv, mb_ret = s_lp[real], s_val[real], s_adv[real], s_ret[real]
                else:
                    log_prob, entropy, value = self.model.evaluate(obs[mb], actions[mb])
                    mb_old_lp, mb_old_v, mb_adv, mb_ret = old_log_probs[mb], old_values[mb], advantages[mb], returns[mb]
                log_ratio = log_prob - mb_old_lp
                ratio = log_ratio.exp()
                with torch.no_grad():
                    approx_kls.append(((ratio - 1) - log_ratio).mean())
                    clip_fracs.append(((ratio - 1.0).abs() > cfg.clip_coef).float().mean())
                if cfg.norm_adv and mb_adv.numel() > 1:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(
                    -mb_adv * ratio, -mb_adv * ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)
                ).mean()
                if cfg.clip_vloss:
                    v_clipped = mb_old_v + (value - mb_old_v).clamp(-cfg.clip_coef, cfg.clip_coef)
                    v_loss = 0.5 * torch.max((value - mb_ret) ** 2, (v_clipped - mb_ret) ** 2).mean()
                else:
                    v_loss = 0.5 * ((value - mb_ret) ** 2).mean()
                entropy_loss = entropy.mean()
                loss = pg_loss - cfg.ent_coef * entropy_loss + cfg.vf_coef * v_loss
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = nn.utils.clip_grad_norm_(self._params, cfg.max_grad_norm)
                check_finite(grad_norm, loss, f"PPO update {self._version + 1}")
                self.optimizer.step()
            if cfg.target_kl is not None and float(torch.stack(approx_kls[-cfg.minibatches:]).mean()) > cfg.target_kl:
                break
        norm = getattr(self.model, "obs_norm", None)
        if norm is not None:
            # After the gradient steps: this update evaluated the batch with the statistics it was
            # acted on with; the new ones go to the server with these weights.
            norm.update(obs)
        self._version += 1
        var_y = returns.var()
        explained = float(1 - (returns - old_values).var() / var_y) if var_y > 0 else float("nan")
        metrics.update(
            policy_loss=float(pg_loss.detach()),
            value_loss=float(v_loss.detach()),
            entropy=float(entropy_loss.detach()),
            approx_kl=float(torch.stack(approx_kls).mean()),
            clip_fraction=float(torch.stack(clip_fracs).mean()),
            explained_variance=explained,
            grad_norm=float(grad_norm),
            lr=float(self.optimizer.param_groups[0]["lr"]),
            trained_frames=float(n),
        )
        return metrics
