"""A CleanRL-style single-file *recurrent* PPO: the baseline for the pipeline's recurrent PPO.

The recurrent counterpart of :mod:`pipeline.bench.reference_ppo`, for the
cases a feed-forward policy cannot solve: envs whose velocities are hidden
(``--no-velocity 1``, :class:`components.partial_obs.NoVelocityEnvFactory`),
where only a policy with memory can infer motion from consecutive frames.
One synchronous loop in the spirit of CleanRL's ``ppo_atari_lstm.py``, but
for vector observations and written for this repository: an MLP encoder
feeding an LSTM or GRU, actor and critic heads on its output (with
``--critic-trunk 1`` the critic has an encoder and core of its own, as the
pipeline's MLP recurrent model and the RL Zoo's RecurrentPPO do); the recurrent
state is zeroed at the first step of each new episode (multiplied by
``1 - done``), the state at the start of each rollout is kept, and the
update re-runs each env's whole rollout from that state, minibatches being
made of whole envs. Everything else (GAE, clipped surrogate, value
clipping, advantage normalisation, annealed learning rate, the env-side
normalisation for continuous actions) and the ``metrics.jsonl`` rows
(``frames``, ``time``, ``episode/return_mean``, a final ``summary`` and
``eval/return_mean``) are those of ``reference_ppo``, so
``python -m pipeline.bench.learn`` and ``python -m pipeline.report`` read
both alike.

    python -m pipeline.bench.reference_rppo --env-id CartPole-v1 --no-velocity 1 --total-frames 100000 --out runs/rref
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

#: the recurrent state: ``(h, c)`` for an LSTM, ``(h,)`` for a GRU, each ``[layers, envs, rnn_hidden]``
State = tuple[torch.Tensor, ...]

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


def _init(layer: nn.Linear, std: float = 2**0.5) -> nn.Linear:
    """CleanRL's layer init: orthogonal weights with gain ``std``, zero bias."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, 0.0)
    return layer


class RecurrentTrunk(nn.Module):
    """Encoder -> LSTM/GRU: what turns a sequence of observations into features, carrying its own state."""

    def __init__(self, obs_dim: int, hidden: int, rnn: str, rnn_hidden: int, rnn_layers: int, activation: str) -> None:
        super().__init__()
        self.lstm = rnn == "lstm"
        self.encoder = nn.Sequential(_init(nn.Linear(obs_dim, hidden)), ACTIVATIONS[activation]())
        cell = nn.LSTM if self.lstm else nn.GRU
        self.rnn = cell(hidden, rnn_hidden, num_layers=rnn_layers)
        for name, param in self.rnn.named_parameters():  # CleanRL's recurrent init
            if "bias" in name:
                nn.init.constant_(param, 0.0)
            elif "weight" in name:
                nn.init.orthogonal_(param, 1.0)

    def initial_state(self, batch: int) -> State:
        shape = (self.rnn.num_layers, batch, self.rnn.hidden_size)
        return (torch.zeros(shape), torch.zeros(shape)) if self.lstm else (torch.zeros(shape),)

    def _step_rnn(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        if self.lstm:
            out, (h, c) = self.rnn(x, (state[0], state[1]))
            return out, (h, c)
        out, h = self.rnn(x, state[0])
        return out, (h,)

    def features(self, x: torch.Tensor, state: State, done: torch.Tensor) -> tuple[torch.Tensor, State]:
        """The core's output for a time-major sequence ``x`` (``[T * B, obs]``) from ``state``, and the state after.

        ``done[t]`` (``[T, B]``) says observation ``t`` is the first of a new
        episode, so the state entering step ``t`` is zeroed for those envs,
        exactly as CleanRL's ``get_states`` does step by step. Why in chunks:
        between two steps where any env restarts nothing is zeroed, so each
        such stretch is one call of the RNN (the same result, far fewer calls).
        """
        steps, batch = done.shape
        h = self.encoder(x).reshape(steps, batch, -1)
        restarts = (torch.nonzero(done[1:].any(dim=1)).flatten() + 1).tolist()
        bounds = [0, *restarts, steps]
        outs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            keep = (1.0 - done[start]).view(1, batch, 1)
            state = tuple(s * keep for s in state)
            out, state = self._step_rnn(h[start:end], state)
            outs.append(out)
        return torch.cat(outs).reshape(steps * batch, -1), state


class RecurrentAgent(nn.Module):
    """A recurrent trunk, actor and critic heads on its output (``ppo_atari_lstm``'s shared core), or, with
    ``critic_trunk``, the critic on a trunk of its own (the RL Zoo RecurrentPPO's ``enable_critic_lstm``).

    The state is the actor trunk's leaves followed by the critic trunk's, if any.
    """

    def __init__(self, obs_dim: int, action_dim: int, discrete: bool, hidden: int, rnn: str, rnn_hidden: int,
                 rnn_layers: int, activation: str, critic_trunk: bool = False) -> None:
        super().__init__()
        self.discrete = discrete
        self.trunk = RecurrentTrunk(obs_dim, hidden, rnn, rnn_hidden, rnn_layers, activation)
        self.critic_trunk = (RecurrentTrunk(obs_dim, hidden, rnn, rnn_hidden, rnn_layers, activation)
                             if critic_trunk else None)
        self._leaves = 2 if rnn == "lstm" else 1
        self.actor = _init(nn.Linear(rnn_hidden, action_dim), 0.01)
        self.critic = _init(nn.Linear(rnn_hidden, 1), 1.0)
        if not discrete:
            self.log_std = nn.Parameter(torch.zeros(1, action_dim))

    def initial_state(self, batch: int) -> State:
        """Zeros: the state an env starts (and restarts after each episode) with."""
        critic = self.critic_trunk.initial_state(batch) if self.critic_trunk is not None else ()
        return self.trunk.initial_state(batch) + critic

    def features(self, x: torch.Tensor, state: State, done: torch.Tensor) -> tuple[torch.Tensor, State]:
        """The actor's features and the whole state after (the critic's part advanced too, when it has a trunk)."""
        feat, actor_state = self.trunk.features(x, state[: self._leaves], done)
        if self.critic_trunk is None:
            return feat, actor_state
        _, critic_state = self.critic_trunk.features(x, state[self._leaves :], done)
        return feat, actor_state + critic_state

    def _critic_features(self, x: torch.Tensor, state: State, done: torch.Tensor,
                         actor_feat: torch.Tensor) -> tuple[torch.Tensor, State]:
        if self.critic_trunk is None:
            return actor_feat, ()
        return self.critic_trunk.features(x, state[self._leaves :], done)

    def value(self, x: torch.Tensor, state: State, done: torch.Tensor) -> torch.Tensor:
        feat, _ = self.trunk.features(x, state[: self._leaves], done)
        return self.critic(self._critic_features(x, state, done, feat)[0]).squeeze(-1)

    def dist(self, feat: torch.Tensor) -> Categorical | Normal:
        out = self.actor(feat)
        if self.discrete:
            return Categorical(logits=out)
        return Normal(out, self.log_std.expand_as(out).exp())

    def act(self, x: torch.Tensor, state: State, done: torch.Tensor,
            action: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, State]:
        """Action (sampled unless given), its log-prob, entropy, value, and the state after the sequence."""
        feat, actor_state = self.trunk.features(x, state[: self._leaves], done)
        critic_feat, critic_state = self._critic_features(x, state, done, feat)
        d = self.dist(feat)
        if action is None:
            action = d.sample()
        log_prob, entropy = d.log_prob(action), d.entropy()
        if not self.discrete:
            log_prob, entropy = log_prob.sum(-1), entropy.sum(-1)
        return action, log_prob, entropy, self.critic(critic_feat).squeeze(-1), actor_state + critic_state


def _base_env(env_id: str, no_velocity: bool) -> gym.Env:
    """The env itself: with only its position entries observed when ``no_velocity`` (training and evaluation alike)."""
    if no_velocity:
        from components.partial_obs import NoVelocityEnvFactory

        return NoVelocityEnvFactory(env_id)()
    return gym.make(env_id)


def _make_env(env_id: str, no_velocity: bool, gamma: float, normalize: bool, seed: int,
              index: int, reward_scale: bool = False) -> Callable[[], gym.Env]:
    def thunk() -> gym.Env:
        env = _base_env(env_id, no_velocity)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        if isinstance(env.action_space, gym.spaces.Box):
            env = gym.wrappers.ClipAction(env)
        if normalize:  # as model.obs_norm (running mean/std, clipped to +-10)
            env = gym.wrappers.NormalizeObservation(env)
            env = gym.wrappers.TransformObservation(env, lambda o: np.clip(o, -10, 10), env.observation_space)
        if reward_scale:  # as trainer.reward_scale
            env = gym.wrappers.NormalizeReward(env, gamma=gamma)
            env = gym.wrappers.TransformReward(env, lambda r: float(np.clip(r, -10, 10)))
        env.action_space.seed(seed + index)
        return env
    return thunk


def _episode_returns(info: dict[str, Any]) -> list[float]:
    """The returns of the episodes that ended this step (with same-step autoreset their stats are in ``final_info``)."""
    for source in (info.get("final_info"), info):
        if isinstance(source, dict) and "episode" in source:
            ended = np.asarray(source.get("_episode", np.ones(len(source["episode"]["r"]), bool)))
            return [float(r) for r in np.asarray(source["episode"]["r"])[ended]]
    return []


def _evaluate(agent: RecurrentAgent, env_id: str, no_velocity: bool, obs_rms: Any, episodes: int, seed: int) -> float:
    """Greedy episodes on fresh envs of the training kind, the state carried from zeros through each episode."""
    returns = []
    for i in range(episodes):
        env = _base_env(env_id, no_velocity)
        obs, _ = env.reset(seed=seed + 10_000 + i)
        state, carry = agent.initial_state(1), torch.zeros(1, 1)  # never reset within an episode
        total, done = 0.0, False
        while not done:
            x = np.asarray(obs, np.float64).reshape(-1)
            if obs_rms is not None:
                x = np.clip((x - obs_rms.mean) / np.sqrt(obs_rms.var + 1e-8), -10, 10)
            with torch.no_grad():
                feat, state = agent.features(torch.as_tensor(x, dtype=torch.float32)[None], state, carry)
                out = agent.actor(feat)
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
    p = argparse.ArgumentParser(prog="python -m pipeline.bench.reference_rppo", description=__doc__.splitlines()[0])
    p.add_argument("--env-id", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-frames", type=int, default=1_000_000)
    p.add_argument("--num-envs", type=int, default=1)
    p.add_argument("--frames-per-batch", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--anneal-lr", type=int, default=1)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--minibatches", type=int, default=32, help="of whole envs: num_envs // minibatches envs each")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--clip-vloss", type=int, default=1)
    p.add_argument("--ent-coef", type=float, default=0.0)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--normalize", type=int, default=1, help="observation normalisation (model.obs_norm)")
    p.add_argument("--reward-scale", type=int, default=0, help="reward normalisation (trainer.reward_scale)")
    p.add_argument("--hidden", type=int, default=64, help="units of the encoder's one hidden layer")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rnn", choices=("lstm", "gru"), default="lstm")
    p.add_argument("--rnn-hidden", type=int, default=128)
    p.add_argument("--rnn-layers", type=int, default=1)
    p.add_argument("--no-velocity", type=int, default=0, help="1: hide the velocities (components.partial_obs)")
    p.add_argument("--activation", choices=tuple(ACTIVATIONS), default="tanh")
    p.add_argument("--critic-trunk", type=int, default=0, help="1: the critic has its own encoder and core")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(1)
    no_velocity = bool(args.no_velocity)
    probe = _base_env(args.env_id, no_velocity)
    discrete = isinstance(probe.action_space, gym.spaces.Discrete)
    probe.close()
    normalize = bool(args.normalize)
    # same-step autoreset: the observation after an end is the new episode's first, flagged done, as in CleanRL's
    # gymnasium 0.29 loop; the recurrent state is zeroed there and no terminal-observation step enters the batch
    envs = gym.vector.SyncVectorEnv([_make_env(args.env_id, no_velocity, args.gamma, normalize, args.seed, i,
                                               bool(args.reward_scale))
                                     for i in range(args.num_envs)], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    action_dim = envs.single_action_space.n if discrete else int(np.prod(envs.single_action_space.shape))
    agent = RecurrentAgent(obs_dim, action_dim, discrete, args.hidden, args.rnn, args.rnn_hidden, args.rnn_layers,
                           args.activation, bool(args.critic_trunk))
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    steps = max(1, args.frames_per_batch // args.num_envs)
    batch = steps * args.num_envs
    envs_per_mb = max(1, args.num_envs // args.minibatches)
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
    next_state = agent.initial_state(args.num_envs)
    for update in range(updates):
        initial_state = tuple(s.clone() for s in next_state)
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = args.lr * (1.0 - update / updates)
        for t in range(steps):
            obs_buf[t], done_buf[t] = next_obs, next_done
            with torch.no_grad():
                action, logp, _, value, next_state = agent.act(next_obs, next_state, next_done[None])
            act_buf[t], logp_buf[t], val_buf[t] = action, logp, value
            obs, reward, terminated, truncated, info = envs.step(action.numpy())
            frames += args.num_envs
            rew_buf[t] = torch.as_tensor(reward, dtype=torch.float32)
            next_obs = torch.as_tensor(obs, dtype=torch.float32).reshape(args.num_envs, -1)
            next_done = torch.as_tensor(np.logical_or(terminated, truncated), dtype=torch.float32)
            for r in _episode_returns(info):
                returns.append(r)
                episodes += 1
        with torch.no_grad():
            next_value = agent.value(next_obs, next_state, next_done[None])
            adv = torch.zeros_like(rew_buf)
            running = torch.zeros(args.num_envs)
            for t in reversed(range(steps)):
                not_done = 1.0 - (next_done if t == steps - 1 else done_buf[t + 1])
                nv = next_value if t == steps - 1 else val_buf[t + 1]
                delta = rew_buf[t] + args.gamma * nv * not_done - val_buf[t]
                running = delta + args.gamma * args.gae_lambda * not_done * running
                adv[t] = running
            ret = adv + val_buf
        for _ in range(args.epochs):
            perm = torch.randperm(args.num_envs)
            for start in range(0, args.num_envs, envs_per_mb):
                mb = perm[start : start + envs_per_mb]  # whole envs, each re-run over its rollout, time-major
                mb_state = tuple(s[:, mb] for s in initial_state)
                _, logp, entropy, value, _ = agent.act(obs_buf[:, mb].reshape(-1, obs_dim), mb_state, done_buf[:, mb],
                                                       act_buf[:, mb].reshape((-1,) + act_buf.shape[2:]))
                old_logp, old_val = logp_buf[:, mb].reshape(-1), val_buf[:, mb].reshape(-1)
                mb_adv, mb_ret = adv[:, mb].reshape(-1), ret[:, mb].reshape(-1)
                ratio = (logp - old_logp).exp()
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
                if args.clip_vloss:
                    clipped = old_val + (value - old_val).clamp(-args.clip_coef, args.clip_coef)
                    v_loss = 0.5 * torch.max((value - mb_ret) ** 2, (clipped - mb_ret) ** 2).mean()
                else:
                    v_loss = 0.5 * ((value - mb_ret) ** 2).mean()
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
    if normalize:
        wrapper = envs.envs[0]
        while not isinstance(wrapper, gym.wrappers.NormalizeObservation):
            wrapper = wrapper.env
        obs_rms = wrapper.obs_rms
    evaluated = _evaluate(agent, args.env_id, no_velocity, obs_rms, args.eval_episodes, args.seed)
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
