"""What each trainer's run is configured with: plain dataclasses, free of torch.

Hydra composes every config against these (``pipeline.plan.schema``), so a
mistyped key or value is reported before torch loads (a second or more of a
fresh process); the trainers (:mod:`components.trainers.ppo`, ``dqn``,
``sac``) read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from components.trainers.budget import RunBudget


@dataclass
class PPOConfig(RunBudget):
    """What one PPO run does: its budget (:class:`RunBudget`) and hyper-parameters,
    which keep the CleanRL names and meanings."""

    name: str = "ppo"
    #: Adam learning rate
    lr: float = 2.5e-4
    #: anneal the learning rate linearly to 0 at total_frames
    anneal_lr: bool = True
    #: discount factor
    gamma: float = 0.99
    #: GAE lambda
    gae_lambda: float = 0.95
    #: passes over each batch
    epochs: int = 4
    #: minibatches per pass
    minibatches: int = 4
    #: policy-ratio clip range
    clip_coef: float = 0.2
    #: clip the value loss as the policy loss (CleanRL's clip_vloss)
    clip_vloss: bool = True
    #: entropy bonus coefficient
    ent_coef: float = 0.01
    #: value loss coefficient
    vf_coef: float = 0.5
    #: global gradient-norm clip
    max_grad_norm: float = 0.5
    #: normalise advantages per minibatch
    norm_adv: bool = True
    #: stop an update's epochs early once the approximate KL exceeds this (None: never)
    target_kl: float | None = None
    #: drop transitions more than this many updates old
    max_policy_lag: int = 3  # as conf/trainer/ppo.yaml: one default, whichever way the trainer is built
    #: Adam epsilon
    adam_eps: float = 1e-5
    #: divide rewards by the running std of discounted returns (gymnasium's NormalizeReward)
    reward_scale: bool = False
    #: pause collection during each update, so the next batch is collected by the weights it trains
    #: (policy lag ~0, as in CleanRL's synchronous loop) instead of by the previous ones (lag 1)
    sync_collection: bool = False
    #: a recurrent model (model.rnn) is trained on sequences of at most this many consecutive steps of one env,
    #: each from the state recorded with its first step (components/trainers/sequences.py); null: each env's whole
    #: trajectories in the batch, as CleanRL's and the RL Zoo's recurrent PPO (a batch's steps per env at most)
    seq_len: int | None = None


@dataclass
class DQNConfig(RunBudget):
    """What one DQN run does: budget, stopping rule, hyper-parameters.

    ``updates_per_batch`` gradient steps follow every collected batch of
    ``frames_per_batch`` transitions, so the replay ratio is
    ``updates_per_batch * batch_size / frames_per_batch`` samples per frame.
    ``tau`` = 1 copies the online network into the target network every
    ``target_update_period`` updates; ``tau`` < 1 blends it in (Polyak).
    """

    name: str = "dqn"
    #: Adam learning rate
    lr: float = 2.3e-3
    #: discount factor
    gamma: float = 0.99
    #: transitions per gradient step
    batch_size: int = 64
    #: gradient steps after every collected batch
    updates_per_batch: int = 128
    #: transitions collected before the first update
    learning_starts: int = 1000
    #: updates between target-network refreshes
    target_update_period: int = 10
    #: target refresh: 1 copies the online network, < 1 blends it in (Polyak)
    tau: float = 1.0
    #: Double DQN targets (the online network picks the next action)
    double: bool = True
    #: steps of reward in each target (n-step returns)
    n_step: int = 1
    #: Huber loss threshold
    huber_delta: float = 1.0
    #: global gradient-norm clip
    max_grad_norm: float = 10.0
    #: initial exploration epsilon
    eps_start: float = 1.0
    #: final exploration epsilon
    eps_end: float = 0.04
    #: fraction of total_frames over which epsilon falls linearly
    eps_fraction: float = 0.16
    #: Adam epsilon
    adam_eps: float = 1e-8


@dataclass
class SACConfig(RunBudget):
    """What one SAC run does: budget, stopping rule, hyper-parameters (CleanRL's names where it has them).

    ``updates_per_frame`` is the update-to-data ratio: gradient steps of the
    critics per collected transition (1.0: CleanRL's one step per env step).
    """

    name: str = "sac"
    #: actor Adam learning rate (CleanRL policy_lr)
    actor_lr: float = 3e-4
    #: critics' Adam learning rate (CleanRL q_lr)
    critic_lr: float = 1e-3
    #: entropy-coefficient Adam learning rate (CleanRL uses q_lr)
    alpha_lr: float = 1e-3
    #: discount factor
    gamma: float = 0.99
    #: Polyak step of the target critics: target += tau * (online - target)
    tau: float = 0.005
    #: transitions per gradient step
    batch_size: int = 256
    #: transitions in replay before the first update (collected with the initial, random-ish actor)
    learning_starts: int = 5000
    #: critic gradient steps per collected transition (the update-to-data ratio)
    updates_per_frame: float = 1.0
    #: critic steps between actor updates (that many actor steps then: TD3's delayed update, CleanRL's way)
    policy_frequency: int = 2
    #: critic steps between Polyak steps of the target critics
    target_update_period: int = 1
    #: the entropy coefficient (its initial value with autotune)
    alpha: float = 0.2
    #: tune the entropy coefficient toward target_entropy
    autotune: bool = True
    #: the entropy the coefficient is tuned for (null: -|A|, the action dimension)
    target_entropy: float | None = None
    #: steps of reward in each target (n-step returns from the replay)
    n_step: int = 1
    #: global gradient-norm clip of each network (null: none, as in CleanRL)
    max_grad_norm: float | None = None
    #: hidden widths of each critic
    critic_hidden: list[int] = field(default_factory=lambda: [256, 256])
    #: the critics' activation
    critic_activation: str = "relu"
    #: Adam epsilon
    adam_eps: float = 1e-8

