"""What a model must provide to be trained and served, checked once on the driver before anything starts.

``model._target_`` may name any ``torch.nn.Module`` class built as
``cls(env_spec, **kwargs)`` (the ``model.*`` keys its constructor takes, see
:func:`accepted_kwargs`). Every placement calls ``act(inputs, modes)``:
``inputs["observation"]`` a batch of observations (a Dict/Tuple
observation: a nested ``TensorDict`` of its leaves, wherever the model
runs), ``modes`` the
interaction mode per row (:class:`~components.interaction.InteractionMode`);
it returns a dict of tensors with one row per observation. The trainers
call more:

- PPO: ``act`` returns ``action`` (the action space's shape and dtype kind),
  ``sample_log_prob`` and ``state_value`` (one float each per row);
  ``evaluate(obs, action) -> (log_prob, entropy, value)``, one float each per
  row; ``value(obs)``, one float per row.
- DQN: ``forward(obs)`` returns ``[rows, action_n]`` action values; ``act``
  returns ``action``; an ``epsilon`` buffer (the exploration rate the trainer
  sets and the weights carry to the server).

``model._target_`` may also name a function returning a
``tensordict.nn.TensorDictModule``: :mod:`components.td_policy` says which
``out_keys`` it must write, and wraps it into the methods above.

A model that breaks it would fail in a worker or the server process, in
torch's words, after every process started; :func:`check_model` runs one
small batch through it on the driver and says what is wrong in one line.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

from components.envs import EnvSpec
from components.obs_tree import model_observation

#: what each trainer calls on its model, beyond ``act``
NEEDS = {"ppo": ("act", "evaluate", "value"), "dqn": ("act", "forward"), "sac": ("act", "sample")}


class ModelContractError(ValueError):
    """A model that does not provide what the trainer and the server call (one line)."""


def accepted_kwargs(cls: Any, kwargs: Mapping[str, Any], optional: set[str]) -> dict[str, Any]:
    """``kwargs`` without the ``optional`` keys ``cls``'s constructor does not take (all, if it takes ``**kwargs``).

    The ``model.*`` keys every model config has (encoder, hidden, ...) are
    optional: a user's model that takes ``width`` only gets ``width``. Any
    other key is passed as given, so a misspelt one is the constructor's
    one-line error, not a silently dropped setting.
    """
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass everything
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names or k not in optional}


def _rows(name: str, value: Any, shape: tuple[int, ...], kinds: str, what: str) -> None:
    import torch

    if not isinstance(value, torch.Tensor):
        raise ModelContractError(f"{what} returned {name} as {type(value).__name__}, not a tensor")
    if tuple(value.shape) != shape:
        raise ModelContractError(f"{what} returned {name} of shape {tuple(value.shape)}; expected {shape}")
    floating = value.dtype.is_floating_point
    if floating != (kinds == "f"):
        raise ModelContractError(f"{what} returned {name} as {value.dtype}; expected a "
                                 + ("float" if kinds == "f" else "integer") + " tensor")


def check_model(model: Any, spec: EnvSpec, trainer: str, rows: int = 2) -> None:
    """Run ``rows`` observations through ``model`` as the server and ``trainer`` would; one line if it breaks."""
    import torch

    name = type(model).__name__
    why_not = getattr(model, "missing_for", None)  # a wrapper that knows what it lacks says it in its words
    reason = why_not(trainer) if callable(why_not) else None
    if reason:
        raise ModelContractError(reason)
    missing = [m for m in NEEDS.get(trainer, ("act",)) if not callable(getattr(model, m, None))]
    if missing:
        raise ModelContractError(f"{name} has no {', '.join(missing)} method(s); trainer={trainer} calls "
                                 f"{', '.join(NEEDS.get(trainer, ('act',)))} (see components/model_contract.py)")
    if trainer == "dqn" and not isinstance(getattr(model, "epsilon", None), torch.Tensor):
        raise ModelContractError(f"{name} has no epsilon buffer; trainer=dqn sets the exploration rate there")
    reference = next(iter([*model.parameters(), *model.buffers()]), None) if isinstance(model, torch.nn.Module) else None
    device = reference.device if reference is not None else torch.device("cpu")
    packed = torch.from_numpy(np.broadcast_to(spec.zero_observation(), (rows, *spec.obs_shape)).copy()).to(device)
    obs = model_observation(spec.obs_leaves, packed)  # a Dict/Tuple: its leaves, as every caller hands them
    modes = torch.zeros(rows, dtype=torch.int8, device=device)
    action_kinds = "f" if spec.action_kind == "continuous" else "iub"
    try:
        with torch.no_grad():
            out = model.act({"observation": obs}, modes)
            if not isinstance(out, Mapping) or "action" not in out:
                raise ModelContractError(f"{name}.act returned {type(out).__name__}"
                                         + (f" with keys {sorted(out)}" if isinstance(out, Mapping) else "")
                                         + "; expected a dict with at least 'action'")
            _rows("action", out["action"], (rows, *spec.action_shape), action_kinds, f"{name}.act")
            if trainer == "ppo":
                for key in ("sample_log_prob", "state_value"):
                    if key not in out:
                        raise ModelContractError(f"{name}.act returned no {key!r}; trainer=ppo stores it per step")
                    _rows(key, out[key], (rows,), "f", f"{name}.act")
                result = model.evaluate(obs, out["action"])
                if not isinstance(result, tuple) or len(result) != 3:
                    raise ModelContractError(f"{name}.evaluate returned {type(result).__name__}; expected "
                                             "(log_prob, entropy, value)")
                for key, value in zip(("log_prob", "entropy", "value"), result):
                    _rows(key, value, (rows,), "f", f"{name}.evaluate")
                _rows("value", model.value(obs), (rows,), "f", f"{name}.value")
            elif trainer == "dqn":
                _rows("action values", model(obs), (rows, spec.action_n), "f", f"{name}.forward")
        if trainer == "sac":  # with gradients: the actor's loss backpropagates through the sampled action
            result = model.sample(obs)
            if not isinstance(result, tuple) or len(result) != 2:
                raise ModelContractError(f"{name}.sample returned {type(result).__name__}; expected (action, log_prob)")
            _rows("action", result[0], (rows, *spec.action_shape), "f", f"{name}.sample")
            _rows("log_prob", result[1], (rows,), "f", f"{name}.sample")
            if not result[0].requires_grad:
                raise ModelContractError(f"{name}.sample returned an action without a gradient; SAC's actor loss "
                                         "needs a reparameterised (differentiable) draw")
    except ModelContractError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's code: its error, named, in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelContractError(f"{name} failed on a batch of {rows} observations of shape {spec.obs_shape}: "
                                 f"{type(err).__name__}: {first}") from None
