"""A user's ``tensordict.nn.TensorDictModule`` as a model the trainers and the server call.

TorchRL users write policies as TensorDictModules: a network reading
declared ``in_keys`` and writing declared ``out_keys``. ``model._target_``
may name a function ``make(env_spec, **kwargs)`` returning one; the project
wraps it in :class:`TensorDictPolicy`, which reads what the network wrote
and does the rest with the project's own heads (sampling, greedy rows,
masks, log-probabilities, entropy), so the network stays a network.

The network reads ``"observation"`` (for a Dict/Tuple observation, its
leaves as ``("observation", "pos")``, ``("observation", "0")``, ... or the
whole nested TensorDict under ``"observation"``) and writes, by trainer:

- PPO: ``logits`` (``Discrete``, ``MultiDiscrete``, ``MultiBinary`` actions,
  ``[rows, choices]``) or ``loc`` (``Box`` actions, ``[rows, dim]``, with an
  optional ``scale`` per row; without one the std is a learned parameter,
  its log starting at ``model.init_log_std`` if the function takes that
  key, else at 0), and ``state_value`` (``[rows]`` or
  ``[rows, 1]``);
- DQN: ``action_value`` (``[rows, action_n]``), acting epsilon-greedily
  with the ``epsilon`` buffer the trainer sets.

An action mask (the env's, see :mod:`components.action_masks`) is applied
by the wrapper: the network need not know of it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from components.envs import EnvSpec
from components.action_noise import NOISE_KEY
from components.heads import EPSILON_NOISE_WIDTH, GaussianHead, epsilon_greedy, head_for
from components.interaction import InteractionMode
from components.obs_input import mask_rows, masked
from components.obs_tree import observation_tree

#: the out_key carrying the actor's output, by action kind
ACTOR_KEY = {"discrete": "logits", "multi_discrete": "logits", "multi_binary": "logits", "continuous": "loc"}
#: what each trainer needs the network to write
TRAINER_KEYS = {"ppo": ("actor", "state_value"), "dqn": ("action_value",)}


def is_tensordict_module(obj: Any) -> bool:
    """Whether ``obj`` is a ``TensorDictModuleBase`` (``TensorDictModule``, ``TensorDictSequential``, ...).

    Asked of every model built, so it never imports tensordict itself (that import costs ~2 s: it loads
    ``torch._dynamo``): a TensorDictModule exists only where its maker already imported ``tensordict.nn``.
    """
    nn_module = sys.modules.get("tensordict.nn")
    return nn_module is not None and isinstance(obj, nn_module.TensorDictModuleBase)


def _key_name(key: Any) -> str:
    return "/".join(key) if isinstance(key, tuple) else str(key)


class TensorDictPolicy(nn.Module):
    """Serves and trains ``module`` through the project's heads (see the module docstring for its keys)."""

    def __init__(self, module: nn.Module, spec: EnvSpec, init_log_std: float = 0.0) -> None:
        super().__init__()
        self.module, self.spec = module, spec
        out_keys = {_key_name(k) for k in getattr(module, "out_keys", ())}
        self.actor_key = ACTOR_KEY[spec.action_kind]
        self.has_actor = self.actor_key in out_keys
        self.has_value = "state_value" in out_keys
        self.has_q = "action_value" in out_keys
        self.has_scale = "scale" in out_keys and spec.action_kind == "continuous"
        if not (self.has_actor or self.has_q):
            raise ValueError(f"the TensorDictModule writes {sorted(out_keys)}; it must write {self.actor_key!r} "
                             f"(and 'state_value') for trainer=ppo, or 'action_value' for trainer=dqn "
                             f"(see components/td_policy.py)")
        self.head: nn.Module = head_for(spec, init_log_std)
        self.mask_leaf = spec.leaf(spec.action_mask) if spec.action_mask is not None else None
        self.register_buffer("epsilon", torch.ones(()))
        zero = torch.from_numpy(spec.zero_observation()[None].copy())
        available = {k if isinstance(k, tuple) else (k,) for k in self._tensordict(zero).keys(include_nested=True)}
        for key in getattr(module, "in_keys", ()):
            if (key if isinstance(key, tuple) else (key,)) not in available:
                names = sorted(_key_name(k) for k in available)
                raise ValueError(f"the TensorDictModule reads {_key_name(key)!r}, which the observation does "
                                 f"not have (it has {', '.join(names)})")

    def missing_for(self, trainer: str) -> str | None:
        """Why this network cannot be trained by ``trainer`` (None if it can): checked at plan time."""
        if trainer == "sac":
            return ("a TensorDictModule is trained by trainer=ppo or trainer=dqn; trainer=sac needs an actor with "
                    "sample(obs) -> (action, log_prob) (see components/sac_models.py)")
        wanted = {"actor": self.has_actor, "state_value": self.has_value, "action_value": self.has_q}
        missing = [self.actor_key if k == "actor" else k for k in TRAINER_KEYS.get(trainer, ()) if not wanted[k]]
        if not missing:
            return None
        return f"the TensorDictModule writes no {', '.join(repr(k) for k in missing)}; trainer={trainer} needs it"

    def _tensordict(self, obs: torch.Tensor) -> Any:
        from tensordict import TensorDict, TensorDictBase

        # a tree arrives nested (batches, the server); packed rows are nested here for any other caller
        value = obs if isinstance(obs, TensorDictBase) or not self.spec.is_tree else observation_tree(
            self.spec.obs_leaves, obs)
        return TensorDict({"observation": value}, batch_size=obs.shape[:1], device=obs.device)

    @property
    def action_noise_width(self) -> int:
        """Uniforms per row its actions are sampled with (see :mod:`components.action_noise`)."""
        return int(self.head.noise_width) if self.has_actor else EPSILON_NOISE_WIDTH

    def _run(self, obs: torch.Tensor) -> Any:
        return self.module(self._tensordict(obs))

    def _mask(self, obs: torch.Tensor) -> torch.Tensor | None:
        return None if self.mask_leaf is None else mask_rows(self.mask_leaf, obs)

    def _actor(self, out: Any, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        params = out.get(self.actor_key)
        params = params.reshape(params.shape[0], -1)
        if self.actor_key == "logits":
            return masked(params, self._mask(obs)), None
        log_std = out.get("scale").reshape(params.shape[0], -1).log() if self.has_scale else None
        return params, log_std

    @staticmethod
    def _value(out: Any) -> torch.Tensor:
        value = out.get("state_value")
        return value.reshape(value.shape[0])

    def forward(self, obs: torch.Tensor) -> Any:
        """Masked action values (DQN's targets), or the actor's parameters and the values."""
        out = self._run(obs)
        if self.has_q and not self.has_actor:
            q = out.get("action_value")
            return masked(q.reshape(q.shape[0], -1), self._mask(obs))
        params, _ = self._actor(out, obs)
        return params, self._value(out) if self.has_value else None

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self._value(self._run(obs))

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        obs = inputs["observation"]
        out = self._run(obs)
        if not self.has_actor:
            mask = self._mask(obs)
            q = masked(out.get("action_value").reshape(obs.shape[0], -1), mask)
            return {"action": epsilon_greedy(q, self.epsilon, modes, mask, int(InteractionMode.RANDOM),
                                             inputs.get(NOISE_KEY))}
        params, log_std = self._actor(out, obs)
        greedy = None if modes is None else modes != int(InteractionMode.RANDOM)
        if isinstance(self.head, GaussianHead):
            action, log_prob = self.head.act(params, greedy, log_std, noise=inputs.get(NOISE_KEY))
        else:
            action, log_prob = self.head.act(params, greedy, noise=inputs.get(NOISE_KEY))
        result = {"action": action, "sample_log_prob": log_prob}
        if self.has_value:
            result["state_value"] = self._value(out)
        return result

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self._run(obs)
        params, log_std = self._actor(out, obs)
        if isinstance(self.head, GaussianHead):
            log_prob, entropy = self.head.evaluate(params, action, log_std)
        else:
            log_prob, entropy = self.head.evaluate(params, action)
        return log_prob, entropy, self._value(out)
