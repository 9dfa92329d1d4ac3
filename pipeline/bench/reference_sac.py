"""A CleanRL-style single-file SAC: the sequential baseline ``python -m pipeline.bench.learn`` measures SAC against.

Not a product feature: one loop in the spirit of CleanRL's
``sac_continuous_action.py`` (a gymnasium ``SyncVectorEnv``, a numpy replay,
two separate ``SoftQNetwork`` critics with targets, a tanh-squashed Gaussian
actor, the delayed actor update, automatic entropy tuning), written for
this repository. Each vector step is followed by the gradient steps it
earned (``updates_per_frame`` per frame once ``learning_starts`` frames are
in), so it takes the same number of updates as the pipeline's run for the
same budget, one after the other with the env stepping. It writes
``metrics.jsonl`` rows with the pipeline's keys (``frames``, ``time``,
``episode/return_mean``, ``train/updates``, a final ``summary`` with
``eval/return_mean``).

    python -m pipeline.bench.reference_sac --env-id Pendulum-v1 --seed 0 --total-frames 20000 --out runs/ref
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import deque
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class SoftQNetwork(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim + action_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(torch.cat([x, a], 1)))
        return self.fc3(F.relu(self.fc2(x)))


class Actor(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int, hidden: int, low: np.ndarray, high: np.ndarray) -> None:
        super().__init__()
        self.fc1 = nn.Linear(obs_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc_mean = nn.Linear(hidden, action_dim)
        self.fc_logstd = nn.Linear(hidden, action_dim)
        self.register_buffer("action_scale", torch.tensor((high - low) / 2.0, dtype=torch.float32))
        self.register_buffer("action_bias", torch.tensor((high + low) / 2.0, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        log_std = torch.tanh(self.fc_logstd(x))
        return self.fc_mean(x), LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)

    def get_action(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean, log_std = self(x)
        normal = torch.distributions.Normal(mean, log_std.exp())
        x_t = normal.rsample()
        y_t = torch.tanh(x_t)
        action = y_t * self.action_scale + self.action_bias
        log_prob = normal.log_prob(x_t) - torch.log(self.action_scale * (1 - y_t.pow(2)) + 1e-6)
        return action, log_prob.sum(1, keepdim=True), torch.tanh(mean) * self.action_scale + self.action_bias


def _evaluate(actor: Actor, env_id: str, episodes: int, seed: int) -> float:
    """Episodes of the deterministic (mean) action on fresh envs."""
    returns = []
    for i in range(episodes):
        env = gym.make(env_id)
        obs, _ = env.reset(seed=seed + 10_000 + i)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                _, _, mean = actor.get_action(torch.as_tensor(np.asarray(obs, np.float32))[None])
            obs, reward, terminated, truncated, _ = env.step(mean[0].numpy())
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
        env.close()
    return float(np.mean(returns))


class Learner:
    """CleanRL's update, step for step: two critics and their targets, the actor, the entropy coefficient."""

    def __init__(self, obs_dim: int, action_dim: int, low: np.ndarray, high: np.ndarray,
                 args: argparse.Namespace) -> None:
        self.args = args
        hidden = args.hidden
        self.actor = Actor(obs_dim, action_dim, hidden, low, high)
        self.qf1, self.qf2 = SoftQNetwork(obs_dim, action_dim, hidden), SoftQNetwork(obs_dim, action_dim, hidden)
        self.qf1_target = SoftQNetwork(obs_dim, action_dim, hidden)
        self.qf2_target = SoftQNetwork(obs_dim, action_dim, hidden)
        self.qf1_target.load_state_dict(self.qf1.state_dict())
        self.qf2_target.load_state_dict(self.qf2.state_dict())
        self.q_optimizer = torch.optim.Adam(list(self.qf1.parameters()) + list(self.qf2.parameters()), lr=args.q_lr)
        self.actor_optimizer = torch.optim.Adam(list(self.actor.parameters()), lr=args.policy_lr)
        self.target_entropy = -float(action_dim)
        self.log_alpha = torch.tensor(math.log(args.alpha), requires_grad=True)
        self.alpha = self.log_alpha.exp().item() if args.autotune else args.alpha
        self.a_optimizer = torch.optim.Adam([self.log_alpha], lr=args.alpha_lr)
        self.updates = 0

    def update(self, b_obs: torch.Tensor, b_act: torch.Tensor, b_rew: torch.Tensor, b_next: torch.Tensor,
               b_done: torch.Tensor) -> None:
        args = self.args
        actor, qf1, qf2 = self.actor, self.qf1, self.qf2
        with torch.no_grad():
            next_actions, next_log_pi, _ = actor.get_action(b_next)
            min_next = torch.min(self.qf1_target(b_next, next_actions),
                                 self.qf2_target(b_next, next_actions)) - self.alpha * next_log_pi
            next_q = b_rew + (1 - b_done) * args.gamma * min_next.view(-1)
        qf1_loss = F.mse_loss(qf1(b_obs, b_act).view(-1), next_q)
        qf2_loss = F.mse_loss(qf2(b_obs, b_act).view(-1), next_q)
        self.q_optimizer.zero_grad()
        (qf1_loss + qf2_loss).backward()
        self.q_optimizer.step()
        self.updates += 1
        if self.updates % args.policy_frequency == 0:
            for _ in range(args.policy_frequency):
                pi, log_pi, _ = actor.get_action(b_obs)
                actor_loss = ((self.alpha * log_pi) - torch.min(qf1(b_obs, pi), qf2(b_obs, pi))).mean()
                self.actor_optimizer.zero_grad()
                actor_loss.backward()
                self.actor_optimizer.step()
                if args.autotune:
                    with torch.no_grad():
                        _, log_pi, _ = actor.get_action(b_obs)
                    alpha_loss = (-self.log_alpha.exp() * (log_pi + self.target_entropy)).mean()
                    self.a_optimizer.zero_grad()
                    alpha_loss.backward()
                    self.a_optimizer.step()
                    self.alpha = self.log_alpha.exp().item()
        if self.updates % args.target_network_frequency == 0:
            for net, target in ((qf1, self.qf1_target), (qf2, self.qf2_target)):
                for param, target_param in zip(net.parameters(), target.parameters()):
                    target_param.data.copy_(args.tau * param.data + (1 - args.tau) * target_param.data)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench.reference_sac", description=__doc__.splitlines()[0])
    p.add_argument("--env-id", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-frames", type=int, default=1_000_000)
    p.add_argument("--num-envs", type=int, default=1)
    p.add_argument("--buffer-size", type=int, default=1_000_000)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=0.005)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--learning-starts", type=int, default=5000)
    p.add_argument("--policy-lr", type=float, default=3e-4)
    p.add_argument("--q-lr", type=float, default=1e-3)
    p.add_argument("--alpha-lr", type=float, default=1e-3)
    p.add_argument("--policy-frequency", type=int, default=2)
    p.add_argument("--target-network-frequency", type=int, default=1)
    p.add_argument("--alpha", type=float, default=0.2)
    p.add_argument("--autotune", type=int, default=1)
    p.add_argument("--updates-per-frame", type=float, default=1.0)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the pipeline's torch_threads)")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(args.threads)
    n = args.num_envs
    envs = gym.vector.SyncVectorEnv([lambda: gym.wrappers.RecordEpisodeStatistics(gym.make(args.env_id))
                                     for _ in range(n)])
    space = envs.single_action_space
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    action_dim = int(np.prod(space.shape))
    learner = Learner(obs_dim, action_dim, space.low, space.high, args)
    actor = learner.actor

    size = min(args.buffer_size, args.total_frames)
    rb_obs, rb_next = np.zeros((size, obs_dim), np.float32), np.zeros((size, obs_dim), np.float32)
    rb_act, rb_rew, rb_done = np.zeros((size, action_dim), np.float32), np.zeros(size, np.float32), np.zeros(size, np.float32)
    stored = cursor = 0

    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "metrics.jsonl", "w", encoding="utf-8")  # noqa: SIM115
    returns: deque[float] = deque(maxlen=20)
    episodes = 0
    credit = 0.0
    started = last_row = time.monotonic()
    frames = 0
    obs, _ = envs.reset(seed=args.seed)
    envs.action_space.seed(args.seed)
    resetting = np.zeros(n, bool)  # gymnasium 1.x autoresets on the step after an episode ends
    while frames < args.total_frames:
        if frames < args.learning_starts:
            actions = envs.action_space.sample()
        else:
            with torch.no_grad():
                actions, _, _ = actor.get_action(torch.as_tensor(obs, dtype=torch.float32))
            actions = actions.numpy()
        next_obs, rewards, terminated, truncated, infos = envs.step(actions)
        frames += n
        for i in np.flatnonzero(~resetting):  # the step that reset an env is no transition
            rb_obs[cursor], rb_next[cursor], rb_act[cursor] = obs[i], next_obs[i], actions[i]
            rb_rew[cursor], rb_done[cursor] = rewards[i], float(terminated[i])
            cursor, stored = (cursor + 1) % size, min(stored + 1, size)
            if frames > args.learning_starts:
                credit += args.updates_per_frame
        if "episode" in infos:
            for r in np.asarray(infos["episode"]["r"])[infos.get("_episode", np.ones(n, bool))]:
                returns.append(float(r))
                episodes += 1
        resetting = np.logical_or(terminated, truncated)
        obs = next_obs
        while credit >= 1.0 and stored >= args.batch_size:
            credit -= 1.0
            idx = np.random.randint(0, stored, args.batch_size)
            b_obs, b_next = torch.from_numpy(rb_obs[idx]), torch.from_numpy(rb_next[idx])
            b_act, b_rew, b_done = torch.from_numpy(rb_act[idx]), torch.from_numpy(rb_rew[idx]), torch.from_numpy(rb_done[idx])
            learner.update(b_obs, b_act, b_rew, b_next, b_done)
        now = time.monotonic()
        if now - last_row >= 1.0:
            last_row = now
            log.write(json.dumps({"frames": frames, "time": now - started, "train/updates": learner.updates,
                                  "episode/return_mean": float(np.mean(returns)) if returns else None,
                                  "episode/count": episodes, "collector/frames_per_s": frames / (now - started)}) + "\n")
            log.flush()
    wall = time.monotonic() - started
    evaluated = _evaluate(actor, args.env_id, args.eval_episodes, args.seed)
    summary = {"frames": frames, "wall_time_s": wall, "stop_reason": "total_frames", "train/updates": learner.updates,
               "episode/return_mean": float(np.mean(returns)) if returns else None, "episode/count": episodes,
               "eval/return_mean": evaluated, "collector/frames_per_s": frames / wall}
    log.write(json.dumps({"frames": frames, "time": wall, "train/updates": learner.updates,
                          "episode/return_mean": summary["episode/return_mean"]}) + "\n")
    log.write(json.dumps({"frames": frames, "time": wall, "eval/return_mean": evaluated}) + "\n")
    log.write(json.dumps({"summary": summary}) + "\n")
    log.close()
    envs.close()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
