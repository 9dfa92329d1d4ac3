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


class RecurrentTrunk(nn.Module):
    """An encoder and a recurrent core whose state is the leaves ``<prefix>_h`` (and ``<prefix>_c`` for an LSTM).

    Rows enter as ``[rows, features]`` with their state leaves ``[rows,
    layers, hidden]`` (the layout a request row carries) or as ``[steps,
    sequences, features]`` from each sequence's initial state.
    """

    def __init__(self, encoder: nn.Module, core_in: int, rnn: str, hidden: int, layers: int, prefix: str) -> None:
        super().__init__()
        self.encoder = encoder
        self.rnn_kind = rnn
        self.core = (nn.LSTM if rnn == "lstm" else nn.GRU)(core_in, hidden, num_layers=layers)
        for name, param in self.core.named_parameters():  # CleanRL's LSTM init
            if "bias" in name:
                nn.init.constant_(param, 0.0)
            else:
                nn.init.orthogonal_(param, 1.0)
        self.keys = (f"{prefix}_h", f"{prefix}_c") if rnn == "lstm" else (f"{prefix}_h",)
        self.leaves = {key: (layers, hidden) for key in self.keys}

    def _core_state(self, state: Mapping[str, torch.Tensor], keep: torch.Tensor | None) -> Any:
        """Rows' leaves ``[rows, layers, hidden]`` as the core takes them (``[layers, rows, hidden]``)."""
        parts = []
        for key in self.keys:
            value = state[key].to(torch.float32)
            if keep is not None:
                value = value * keep.reshape(-1, 1, 1)
            parts.append(value.transpose(0, 1).contiguous())
        return tuple(parts) if self.rnn_kind == "lstm" else parts[0]

    def forward(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                keep: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The core's outputs for ``x`` (``[steps, rows, features]``) and its state after the last step, per row."""
        out, last = self.core(self.encoder(x), self._core_state(state, keep))
        parts = last if self.rnn_kind == "lstm" else (last,)
        return out, {key: part.transpose(0, 1).contiguous() for key, part in zip(self.keys, parts)}


class RecurrentActorCritic(nn.Module):
    """Actor and critic heads over recurrent trunks: separate ones with the MLP encoder, one shared with the CNN.

    The same split as :class:`~components.models.ActorCritic`: with
    ``encoder="mlp"`` the actor and the critic each have an MLP and a core
    (the RL Zoo's RecurrentPPO default, ``enable_critic_lstm``: the value
    loss does not shape the actor's memory); with ``encoder="nature_cnn"``
    one CNN and one core feed both heads (CleanRL's ``ppo_atari_lstm.py``).
    Built for ``model.rnn=lstm|gru``; every other ``model.*`` key means what
    it means for the feed-forward model.

    Examples:
        >>> spec = EnvSpec((2,), "float32", "discrete", action_n=2)
        >>> model = RecurrentActorCritic(spec, hidden=(8,), rnn="gru", rnn_hidden=4)
        >>> state = zero_state(model, 3)
        >>> out = model.act({"observation": torch.zeros(3, 2), **state, "is_first": torch.ones(3, dtype=torch.bool)},
        ...                 torch.zeros(3, dtype=torch.int8))
        >>> sorted(out), tuple(out["next.recurrent_state_h"].shape)
        (['action', 'next.critic_state_h', 'next.recurrent_state_h', 'sample_log_prob', 'state_value'], (3, 1, 4))
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
        act = ACTIVATIONS[activation]
        self.head: nn.Module = head_for(spec, init_log_std)
        self.inputs = ObservationInput(spec, features)
        self.obs_norm: RunningNorm | None = None
        if encoder == "nature_cnn" and not spec.is_tree:
            if obs_norm:
                raise ValueError("obs_norm applies to vector observations (encoder mlp); images are scaled by /255")
            if len(spec.obs_shape) != 3:
                raise ValueError(f"nature_cnn needs [C, H, W] observations, got shape {spec.obs_shape}")
            cnn = _Frames(NatureCNN(spec.obs_shape[0], spec.obs_shape[1], features))
            self.actor_trunk = RecurrentTrunk(cnn, features, rnn, rnn_hidden, rnn_layers, "recurrent_state")
            self.critic_trunk: RecurrentTrunk | None = None
            self._frames = True  # the trunk's CNN takes the uint8 frames as they are
        elif encoder in ("mlp", "nature_cnn"):  # a tree's images have their CNN in the inputs
            if obs_norm:
                if spec.is_tree or spec.categorical_obs:
                    raise ValueError("model.obs_norm=true needs a vector observation")
                self.obs_norm = RunningNorm((self.inputs.out_dim,), clip=obs_clip)
            hidden = tuple(hidden)
            core_in = hidden[-1] if hidden else self.inputs.out_dim

            def trunk(prefix: str) -> RecurrentTrunk:
                body = mlp(self.inputs.out_dim, hidden, act) if hidden else nn.Identity()
                return RecurrentTrunk(body, core_in, rnn, rnn_hidden, rnn_layers, prefix)

            self.actor_trunk = trunk("recurrent_state")
            self.critic_trunk = trunk("critic_state")
            self._frames = False
        else:
            raise ValueError(f"unknown encoder {encoder!r} (allowed: mlp, nature_cnn)")
        self.actor = layer_init(nn.Linear(rnn_hidden, self.head.dim), 0.01)
        self.critic = layer_init(nn.Linear(rnn_hidden, 1), 1.0)
        #: the state leaves each env's requests carry (see the module docstring)
        self.recurrent_state: dict[str, tuple[int, ...]] = {
            **self.actor_trunk.leaves, **(self.critic_trunk.leaves if self.critic_trunk is not None else {})}

    # ----------------------------------------------------------------- pieces
    def _inputs(self, obs: torch.Tensor) -> torch.Tensor:
        """Observations as the trunks take them: the CNN's frames as they are, vectors encoded and normalised."""
        if self._frames:
            return obs
        x = self.inputs(obs)
        return x if self.obs_norm is None else self.obs_norm(x)

    def _run(self, x: torch.Tensor, state: Mapping[str, torch.Tensor], keep: torch.Tensor | None,
             need_actor: bool = True) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
        """``x`` ``[steps, rows, ...]`` through the trunks: (actor outputs, values ``[steps, rows]``, next state)."""
        out, nxt = self.actor_trunk(x, state, keep) if (need_actor or self.critic_trunk is None) else (None, {})
        if self.critic_trunk is None:
            assert out is not None
            return out, self.critic(out).squeeze(-1), nxt
        critic_out, critic_next = self.critic_trunk(x, state, keep)
        return out, self.critic(critic_out).squeeze(-1), {**nxt, **critic_next}

    def _step(self, obs: torch.Tensor, state: Mapping[str, torch.Tensor],
              is_first: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """One step for a batch of rows: (distribution parameters, values, next state leaves)."""
        keep = None if is_first is None else (~is_first.to(torch.bool)).to(torch.float32)
        out, value, nxt = self._run(self._inputs(obs).unsqueeze(0), state, keep)
        assert out is not None
        return masked(self.actor(out.squeeze(0)), self.inputs.mask(obs)), value.squeeze(0), nxt

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
        for key, rows in next_state.items():
            out["next." + key] = rows
        return out

    def value(self, obs: torch.Tensor, state: Mapping[str, torch.Tensor] | None = None,
              is_first: torch.Tensor | None = None) -> torch.Tensor:
        """Values of one step of ``obs`` from ``state`` (zero state when None)."""
        state = zero_state(self, obs.shape[0], obs.device) if state is None else state
        keep = None if is_first is None else (~is_first.to(torch.bool)).to(torch.float32)
        return self._run(self._inputs(obs).unsqueeze(0), state, keep, need_actor=False)[1].squeeze(0)

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
        x = self._inputs(flat)
        x = x.reshape(s, t, *x.shape[1:]).transpose(0, 1)  # [steps, sequences, ...]
        keep = None if is_first is None else (~is_first[:, 0].to(torch.bool)).to(torch.float32)
        out, value, _ = self._run(x, state, keep)
        assert out is not None
        y = out.transpose(0, 1).reshape(s * t, -1)
        params = masked(self.actor(y), self.inputs.mask(flat))
        log_prob, entropy = self.head.evaluate(params, action.reshape(s * t, *action.shape[2:]))
        return log_prob.reshape(s, t), entropy.reshape(s, t), value.transpose(0, 1)


class _Frames(nn.Module):
    """The Nature CNN over ``[steps, rows, C, H, W]`` frames: one pass over all of them, ``[steps, rows, features]`` out."""

    def __init__(self, cnn: nn.Module) -> None:
        super().__init__()
        self.cnn = cnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps, rows = x.shape[:2]
        return self.cnn(x.reshape(steps * rows, *x.shape[2:])).reshape(steps, rows, -1)
