"""Recurrent actor-critics: memory for partially observed tasks, served by a stateless server.

Why the state travels with the env instead of living in the server: any
rows of any envs can then share a batch, a restarted server or worker
needs no recovery (a fresh env starts from zero state, like an episode),
and the numbers a learner needs to replay a sequence (the state it started
from) are recorded with the transitions by the worker that holds them.

The contract a recurrent model adds to :mod:`components.model_contract`:

- ``recurrent_state``: leaf name -> per-row shape (float32) of its state,
  e.g. ``{"recurrent_state_h": (layers, hidden), "recurrent_state_c": ...}``.
- ``act(inputs, modes)`` reads those leaves and ``inputs["is_first"]``
  (bool per row: the first step of an episode, where the state is zeroed)
  and returns, besides its actions, ``"next.<leaf>"`` for every leaf: the
  state after this step, which the worker sends with the env's next request.
- ``evaluate_sequences(obs, action, state, is_first) -> (log_prob, entropy,
  value)``: ``[sequences, steps, ...]`` inputs from the recorded state at
  each sequence start (``state``: leaf -> ``[sequences, ...]``), one float
  each per place.
- ``value(obs, state=None, is_first=None)``: the value of one step from the
  given state (PPO's bootstrap of a cut trajectory).

Data flow per env step (the worker, :mod:`components.collector.worker`)::

    request: observation, recurrent_state_*, is_first ---> server: act() (batched over any envs)
    response: action, ..., next.recurrent_state_*   <---
    chunk row records the state acted with (and is_first) and the next state;
    the next request carries next.recurrent_state_* (zeros where the episode ended)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from components.action_noise import NOISE_KEY
from components.encoders import ACTIVATIONS, NatureCNN, layer_init, mlp
from components.envs import EnvSpec
from components.heads import head_for
from components.interaction import InteractionMode
from components.normalization import RunningNorm
from components.obs_input import ObservationInput, masked
from components.recurrent_state import IS_FIRST, state_leaves

__all__ = ["CORES", "IS_FIRST", "RecurrentActorCritic", "is_recurrent", "state_leaves", "zero_state"]

#: the recurrent cores ``model.rnn`` names
CORES = ("lstm", "gru")


def is_recurrent(model: Any) -> bool:
    return bool(state_leaves(model))


def zero_state(model: Any, rows: int, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Zero state leaves for ``rows`` rows (an episode's start)."""
    return {k: torch.zeros((rows, *shape), device=device) for k, shape in state_leaves(model).items()}


class RecurrentActorCritic(nn.Module):
    """An encoder, an LSTM or GRU core, and actor and critic heads over the core's output.

    The layout of CleanRL's ``ppo_atari_lstm.py``: one trunk (the MLP or
    the Nature CNN, then the recurrent core) shared by both heads. Built for
    ``model.rnn=lstm|gru``; every other ``model.*`` key means what it means
    for :class:`~components.models.ActorCritic`.

    Examples:
        >>> spec = EnvSpec((2,), "float32", "discrete", action_n=2)
        >>> model = RecurrentActorCritic(spec, hidden=(8,), rnn="gru", rnn_hidden=4)
        >>> state = zero_state(model, 3)
        >>> out = model.act({"observation": torch.zeros(3, 2), **state, "is_first": torch.ones(3, dtype=torch.bool)},
        ...                 torch.zeros(3, dtype=torch.int8))
        >>> sorted(out), tuple(out["next.recurrent_state_h"].shape)
        (['action', 'next.recurrent_state_h', 'sample_log_prob', 'state_value'], (3, 1, 4))
    """

    in_keys = ("observation",)

    def __init__(
        self,
        spec: EnvSpec,
        encoder: str = "mlp",
        hidden: Sequence[int] = (64,),
        features: int = 512,
        init_log_std: float = 0.0,
        activation: str = "tanh",
        obs_norm: bool = False,
        obs_clip: float = 10.0,
        rnn: str = "lstm",
        rnn_hidden: int = 128,
        rnn_layers: int = 1,
    ) -> None:
        super().__init__()
        if rnn not in CORES:
            raise ValueError(f"model.rnn={rnn!r}: allowed are {', '.join(CORES)} (or null: no recurrent core)")
        if rnn_hidden < 1 or rnn_layers < 1:
            raise ValueError(f"model.rnn_hidden={rnn_hidden}, model.rnn_layers={rnn_layers}: both must be >= 1")
        self.spec = spec
        self.rnn_kind = rnn
        act = ACTIVATIONS[activation]
        self.head: nn.Module = head_for(spec, init_log_std)
        self.inputs = ObservationInput(spec, features)
        self.obs_norm: RunningNorm | None = None
        if encoder == "nature_cnn" and not spec.is_tree:
            if obs_norm:
                raise ValueError("obs_norm applies to vector observations (encoder mlp); images are scaled by /255")
            if len(spec.obs_shape) != 3:
                raise ValueError(f"nature_cnn needs [C, H, W] observations, got shape {spec.obs_shape}")
            self.shared: nn.Module | None = NatureCNN(spec.obs_shape[0], spec.obs_shape[1], features)
            self.encoder: nn.Module = nn.Identity()
            core_in = features
        elif encoder in ("mlp", "nature_cnn"):
            if obs_norm:
                if spec.is_tree or spec.categorical_obs:
                    raise ValueError("model.obs_norm=true needs a vector observation")
                self.obs_norm = RunningNorm((self.inputs.out_dim,), clip=obs_clip)
            self.shared = None
            hidden = tuple(hidden)
            self.encoder = mlp(self.inputs.out_dim, hidden, act) if hidden else nn.Identity()
            core_in = hidden[-1] if hidden else self.inputs.out_dim
        else:
            raise ValueError(f"unknown encoder {encoder!r} (allowed: mlp, nature_cnn)")
        core = nn.LSTM if rnn == "lstm" else nn.GRU
        self.core = core(core_in, rnn_hidden, num_layers=rnn_layers)
        for name, param in self.core.named_parameters():  # CleanRL's LSTM init
            if "bias" in name:
                nn.init.constant_(param, 0.0)
            else:
                nn.init.orthogonal_(param, 1.0)
        self.actor = layer_init(nn.Linear(rnn_hidden, self.head.dim), 0.01)
        self.critic = layer_init(nn.Linear(rnn_hidden, 1), 1.0)
        shape = (rnn_layers, rnn_hidden)
        #: the state leaves each env's requests carry (see the module docstring)
        self.recurrent_state: dict[str, tuple[int, ...]] = (
            {"recurrent_state_h": shape, "recurrent_state_c": shape} if rnn == "lstm" else {"recurrent_state_h": shape})

    # ----------------------------------------------------------------- pieces
    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            return self.shared(obs)
        x = self.inputs(obs)
        if self.obs_norm is not None:
            x = self.obs_norm(x)
        return self.encoder(x)

    def _core_state(self, state: Mapping[str, torch.Tensor], keep: torch.Tensor | None) -> Any:
        """Rows' state leaves ``[rows, layers, hidden]`` as the core takes them (``[layers, rows, hidden]``)."""
        def one(key: str) -> torch.Tensor:
            value = state[key].to(torch.float32)
            if keep is not None:
                value = value * keep.reshape(-1, 1, 1)
            return value.transpose(0, 1).contiguous()

        if self.rnn_kind == "lstm":
            return one("recurrent_state_h"), one("recurrent_state_c")
        return one("recurrent_state_h")

    def _state_rows(self, core_state: Any) -> dict[str, torch.Tensor]:
        if self.rnn_kind == "lstm":
            h, c = core_state
            return {"recurrent_state_h": h.transpose(0, 1), "recurrent_state_c": c.transpose(0, 1)}
        return {"recurrent_state_h": core_state.transpose(0, 1)}

    def _step(self, obs: torch.Tensor, state: Mapping[str, torch.Tensor],
              is_first: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """One step for a batch of rows: (distribution parameters, values, the core's next state)."""
        keep = None if is_first is None else (~is_first.to(torch.bool)).to(torch.float32)
        x = self._features(obs)
        out, next_state = self.core(x.unsqueeze(0), self._core_state(state, keep))
        y = out.squeeze(0)
        return masked(self.actor(y), self.inputs.mask(obs)), self.critic(y).squeeze(-1), next_state

    # ------------------------------------------------------------- the contract
    @property
    def action_noise_width(self) -> int:
        return int(self.head.noise_width)

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        obs = inputs["observation"]
        state = {k: inputs[k] for k in self.recurrent_state} if all(k in inputs for k in self.recurrent_state) \
            else zero_state(self, obs.shape[0], obs.device)
        params, value, next_state = self._step(obs, state, inputs.get(IS_FIRST))
        greedy = None if modes is None else modes != int(InteractionMode.RANDOM)
        action, log_prob = self.head.act(params, greedy, noise=inputs.get(NOISE_KEY))
        out = {"action": action, "sample_log_prob": log_prob, "state_value": value}
        for key, rows in self._state_rows(next_state).items():
            out["next." + key] = rows.contiguous()
        return out

    def value(self, obs: torch.Tensor, state: Mapping[str, torch.Tensor] | None = None,
              is_first: torch.Tensor | None = None) -> torch.Tensor:
        """Values of one step of ``obs`` from ``state`` (zero state when None)."""
        state = zero_state(self, obs.shape[0], obs.device) if state is None else state
        return self._step(obs, state, is_first)[1]

    def evaluate(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row as the first step of an episode (zero state): the feed-forward contract's call, for checks."""
        params, value, _ = self._step(obs, zero_state(self, obs.shape[0], obs.device), None)
        log_prob, entropy = self.head.evaluate(params, action)
        return log_prob, entropy, value

    def evaluate_sequences(self, obs: torch.Tensor, action: torch.Tensor, state: Mapping[str, torch.Tensor],
                           is_first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities, entropies and values of ``[sequences, steps]`` from each sequence's recorded state.

        A sequence never crosses an episode end (see
        :mod:`components.trainers.sequences`), so the state needs zeroing at
        most at its first step (``is_first[:, 0]``), which the recorded state
        already is; padded places after a sequence's end are computed and
        then masked out by the caller.
        """
        s, t = obs.shape[:2]
        flat = obs.reshape(s * t, *obs.shape[2:])
        x = self._features(flat).reshape(s, t, -1).transpose(0, 1)  # [steps, sequences, features]
        keep = None if is_first is None else (~is_first[:, 0].to(torch.bool)).to(torch.float32)
        out, _ = self.core(x, self._core_state(state, keep))
        y = out.transpose(0, 1).reshape(s * t, -1)
        params = masked(self.actor(y), self.inputs.mask(flat))
        log_prob, entropy = self.head.evaluate(params, action.reshape(s * t, *action.shape[2:]))
        value = self.critic(y).squeeze(-1)
        return log_prob.reshape(s, t), entropy.reshape(s, t), value.reshape(s, t)

