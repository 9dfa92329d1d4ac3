"""A CleanRL-style single-file PPO: the baseline ``python -m pipeline.bench.learn`` measures against.

Not a product feature: one synchronous loop in the spirit of CleanRL's
``ppo.py`` / ``ppo_continuous_action.py`` (a gymnasium ``SyncVectorEnv``,
rollouts of ``num_steps`` per env, GAE, clipped surrogate, value clipping,
advantage normalisation, annealed learning rate; for continuous actions the
env-side ``NormalizeObservation``/``NormalizeReward`` wrappers and action
clipping), written for this repository. It takes the same
hyper-parameters as the pipeline's run and writes ``metrics.jsonl`` rows
with the same keys (``frames``, ``time``, ``episode/return_mean``, a final
``summary`` and ``eval/return_mean``), so the benchmark and
``python -m pipeline.report`` read both alike.

    python -m pipeline.bench.reference_ppo --env-id Pendulum-v1 --seed 0 --total-frames 100000 --out runs/ref
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal


def _init(layer: nn.Linear, std: float = 2**0.5) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, 0.0)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, action_dim: int, discrete: bool, hidden: int) -> None:
        super().__init__()
        self.discrete = discrete
        self.critic = nn.Sequential(_init(nn.Linear(obs_dim, hidden)), nn.Tanh(), _init(nn.Linear(hidden, hidden)),
                                    nn.Tanh(), _init(nn.Linear(hidden, 1), 1.0))
        self.actor = nn.Sequential(_init(nn.Linear(obs_dim, hidden)), nn.Tanh(), _init(nn.Linear(hidden, hidden)),
                                   nn.Tanh(), _init(nn.Linear(hidden, action_dim), 0.01))
        if not discrete:
            self.log_std = nn.Parameter(torch.zeros(1, action_dim))

    def value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def dist(self, x: torch.Tensor) -> Categorical | Normal:
        out = self.actor(x)
        if self.discrete:
            return Categorical(logits=out)
        return Normal(out, self.log_std.expand_as(out).exp())

    def act(self, x: torch.Tensor, action: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        d = self.dist(x)
        if action is None:
            action = d.sample()
        log_prob, entropy = d.log_prob(action), d.entropy()
        if not self.discrete:
            log_prob, entropy = log_prob.sum(-1), entropy.sum(-1)
        return action, log_prob, entropy, self.value(x)


def _make_env(env_id: str, gamma: float, normalize: bool, seed: int, index: int) -> callable:
    def thunk() -> gym.Env:
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        if normalize:
            env = gym.wrappers.ClipAction(env)
            env = gym.wrappers.NormalizeObservation(env)
            env = gym.wrappers.TransformObservation(env, lambda o: np.clip(o, -10, 10), env.observation_space)
            env = gym.wrappers.NormalizeReward(env, gamma=gamma)
            env = gym.wrappers.TransformReward(env, lambda r: float(np.clip(r, -10, 10)))
        env.action_space.seed(seed + index)
        return env
    return thunk


def _evaluate(agent: Agent, env_id: str, obs_rms: object, episodes: int, seed: int) -> float:
    """Greedy episodes on fresh envs, normalising observations with the training statistics."""
    returns = []
    for i in range(episodes):
        env = gym.make(env_id)
        obs, _ = env.reset(seed=seed + 10_000 + i)
        total, done = 0.0, False
        while not done:
            x = np.asarray(obs, np.float64)
            if obs_rms is not None:
                x = np.clip((x - obs_rms.mean) / np.sqrt(obs_rms.var + 1e-8), -10, 10)
            with torch.no_grad():
                out = agent.actor(torch.as_tensor(x, dtype=torch.float32)[None])
            if agent.discrete:
                action = int(out.argmax(-1))
            else:
                action = np.clip(out[0].numpy(), env.action_space.low, env.action_space.high)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
        env.close()
    return float(np.mean(returns))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench.reference_ppo", description=__doc__.splitlines()[0])
    p.add_argument("--env-id", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-frames", type=int, default=1_000_000)
    p.add_argument("--num-envs", type=int, default=1)
    p.add_argument("--frames-per-batch", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--anneal-lr", type=int, default=1)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--minibatches", type=int, default=32)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--clip-vloss", type=int, default=1)
    p.add_argument("--ent-coef", type=float, default=0.0)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--normalize", type=int, default=1, help="observation and reward normalisation (continuous)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(1)
    envs = gym.vector.SyncVectorEnv([_make_env(args.env_id, args.gamma, bool(args.normalize), args.seed, i)
                                     for i in range(args.num_envs)])
    discrete = isinstance(envs.single_action_space, gym.spaces.Discrete)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    action_dim = envs.single_action_space.n if discrete else int(np.prod(envs.single_action_space.shape))
    agent = Agent(obs_dim, action_dim, discrete, args.hidden)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    steps = max(1, args.frames_per_batch // args.num_envs)
    batch = steps * args.num_envs
    mb_size = max(1, batch // args.minibatches)
    updates = max(1, args.total_frames // batch)
    obs_buf = torch.zeros((steps, args.num_envs, obs_dim))
    act_buf = torch.zeros((steps, args.num_envs) + (() if discrete else (action_dim,)))
    logp_buf, rew_buf, done_buf, val_buf = (torch.zeros((steps, args.num_envs)) for _ in range(4))

    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "metrics.jsonl", "w", encoding="utf-8")  # noqa: SIM115
    returns: deque[float] = deque(maxlen=20)
    episodes = 0
    started = time.monotonic()
    frames = 0
    obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.as_tensor(obs, dtype=torch.float32).reshape(args.num_envs, -1)
    next_done = torch.zeros(args.num_envs)
    for update in range(updates):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = args.lr * (1.0 - update / updates)
        for t in range(steps):
            obs_buf[t], done_buf[t] = next_obs, next_done
            with torch.no_grad():
                action, logp, _, value = agent.act(next_obs)
            act_buf[t], logp_buf[t], val_buf[t] = action, logp, value
            obs, reward, terminated, truncated, info = envs.step(action.numpy())
            frames += args.num_envs
            rew_buf[t] = torch.as_tensor(reward, dtype=torch.float32)
            next_obs = torch.as_tensor(obs, dtype=torch.float32).reshape(args.num_envs, -1)
            next_done = torch.as_tensor(np.logical_or(terminated, truncated), dtype=torch.float32)
            if "episode" in info:  # gymnasium 1.x: per-env arrays with a mask of the envs that ended
                ended = info.get("_episode", np.ones(args.num_envs, bool))
                for r in np.asarray(info["episode"]["r"])[ended]:
                    returns.append(float(r))
                    episodes += 1
        with torch.no_grad():
            next_value = agent.value(next_obs)
            adv = torch.zeros_like(rew_buf)
            running = torch.zeros(args.num_envs)
            for t in reversed(range(steps)):
                not_done = 1.0 - (next_done if t == steps - 1 else done_buf[t + 1])
                nv = next_value if t == steps - 1 else val_buf[t + 1]
                delta = rew_buf[t] + args.gamma * nv * not_done - val_buf[t]
                running = delta + args.gamma * args.gae_lambda * not_done * running
                adv[t] = running
            ret = adv + val_buf
        b_obs, b_act = obs_buf.reshape(batch, obs_dim), act_buf.reshape((batch,) + act_buf.shape[2:])
        b_logp, b_adv, b_ret, b_val = logp_buf.reshape(-1), adv.reshape(-1), ret.reshape(-1), val_buf.reshape(-1)
        for _ in range(args.epochs):
            perm = torch.randperm(batch)
            for start in range(0, batch, mb_size):
                mb = perm[start : start + mb_size]
                _, logp, entropy, value = agent.act(b_obs[mb], b_act[mb])
                ratio = (logp - b_logp[mb]).exp()
                mb_adv = b_adv[mb]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
                if args.clip_vloss:
                    clipped = b_val[mb] + (value - b_val[mb]).clamp(-args.clip_coef, args.clip_coef)
                    v_loss = 0.5 * torch.max((value - b_ret[mb]) ** 2, (clipped - b_ret[mb]) ** 2).mean()
                else:
                    v_loss = 0.5 * ((value - b_ret[mb]) ** 2).mean()
                loss = pg - args.ent_coef * entropy.mean() + args.vf_coef * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
        row = {"frames": frames, "time": time.monotonic() - started,
               "episode/return_mean": float(np.mean(returns)) if returns else None, "episode/count": episodes,
               "collector/frames_per_s": frames / max(time.monotonic() - started, 1e-9)}
        log.write(json.dumps(row) + "\n")
        log.flush()
    obs_rms = None
    if args.normalize:
        wrapper = envs.envs[0]
        while not isinstance(wrapper, gym.wrappers.NormalizeObservation):
            wrapper = wrapper.env
        obs_rms = wrapper.obs_rms
    evaluated = _evaluate(agent, args.env_id, obs_rms, args.eval_episodes, args.seed)
    wall = time.monotonic() - started
    summary = {"frames": frames, "wall_time_s": wall, "stop_reason": "total_frames",
               "episode/return_mean": float(np.mean(returns)) if returns else None, "episode/count": episodes,
               "eval/return_mean": evaluated, "collector/frames_per_s": frames / wall}
    log.write(json.dumps({"frames": frames, "time": wall, "eval/return_mean": evaluated}) + "\n")
    log.write(json.dumps({"summary": summary}) + "\n")
    log.close()
    envs.close()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
