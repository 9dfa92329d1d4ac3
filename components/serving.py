"""Serving engines: how the inference server evaluates a model's ``act``.

``torch`` runs the model itself. ``numpy`` runs a numpy copy of a small MLP
actor-critic. Why a second engine: on the CPU, for the 4-256-row batches an
inference server sees, torch pays a few microseconds of dispatch per op and
(on some builds, e.g. the AVX-512 one this project is benchmarked on) a
tanh about 6x slower than numpy's; measured on the CartPole MLP, numpy
serves a 64-row batch in 54 us against torch's 149 us. The copy is refreshed
whenever new weights are applied, so both engines serve the same policy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from components.interaction import InteractionMode
from components.models import ActorCritic, CategoricalHead

ENGINES = ("auto", "torch", "numpy")


class TorchEngine:
    """Serves ``model.act`` with torch: inputs moved to the policy device, outputs to the host.

    Accepts numpy or torch inputs (shared-slot transports hand over numpy
    views of their banks).
    """

    name = "torch"

    def __init__(self, model: Any, device: str = "cpu", output_device: str = "cpu") -> None:
        self.model = model
        self._device = torch.device(device)
        self._output_device = torch.device(output_device)

    def act(self, inputs: dict[str, Any], modes: Any) -> dict[str, torch.Tensor]:
        tensors = {k: torch.as_tensor(v) for k, v in inputs.items()}
        modes = torch.as_tensor(modes)
        if self._device.type != "cpu":
            tensors = {k: v.to(self._device, non_blocking=True) for k, v in tensors.items()}
            modes = modes.to(self._device, non_blocking=True)
        with torch.no_grad():
            out = self.model.act(tensors, modes)
        if self._device != self._output_device:
            out = {k: v.to(self._output_device) for k, v in out.items()}
        return out

    def refresh(self) -> None:
        """Nothing to do: the engine reads the model's own parameters."""


def numpy_eligible(model: Any, device: str) -> str | None:
    """Why ``model`` cannot be served by the numpy engine, or None if it can."""
    if str(device) != "cpu":
        return f"the policy runs on {device}"
    if not isinstance(model, ActorCritic):
        return f"{type(model).__name__} is not an ActorCritic"
    if model.shared is not None:
        return "only MLP encoders have a numpy engine"
    for net in (model.actor, model.critic):
        for layer in net.modules():
            if isinstance(layer, (nn.Sequential, nn.Linear, nn.Tanh, nn.ReLU)):
                continue
            return f"layer {type(layer).__name__} has no numpy equivalent"
    return None


def _layers(net: nn.Module) -> list[tuple[np.ndarray, np.ndarray, str | None]]:
    """(weight^T, bias, activation after it) for each Linear of ``net``, in order."""
    layers: list[tuple[np.ndarray, np.ndarray, str | None]] = []
    for module in net.modules():
        if isinstance(module, nn.Linear):
            weight = module.weight.detach().cpu().numpy().T.copy()
            layers.append((weight, module.bias.detach().cpu().numpy().copy(), None))
        elif isinstance(module, (nn.Tanh, nn.ReLU)):
            w, b, _ = layers[-1]
            layers[-1] = (w, b, "tanh" if isinstance(module, nn.Tanh) else "relu")
    return layers


def _apply(x: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray, str | None]]) -> np.ndarray:
    for weight, bias, activation in layers:
        x = x @ weight
        x += bias
        if activation == "tanh":
            np.tanh(x, out=x)
        elif activation == "relu":
            np.maximum(x, 0.0, out=x)
    return x


class NumpyActorCritic:
    """A numpy copy of an MLP :class:`ActorCritic` with the same ``act`` contract.

    Returns numpy arrays (which shared-slot transports copy straight into
    their banks). The first layers of actor and critic read the same input,
    so they run as one matrix product.

    Examples:
        >>> from components.envs import EnvSpec
        >>> model = ActorCritic(EnvSpec((4,), "float32", "discrete", action_n=2))
        >>> engine = NumpyActorCritic(model, seed=0)
        >>> out = engine.act({"observation": np.zeros((3, 4), np.float32)}, np.ones(3, np.int8))
        >>> ref = model.act({"observation": torch.zeros(3, 4)}, torch.ones(3, dtype=torch.int8))
        >>> out["action"].tolist() == ref["action"].tolist()
        True
    """

    in_keys = ("observation",)
    name = "numpy"

    def __init__(self, model: ActorCritic, seed: int | None = None) -> None:
        reason = numpy_eligible(model, "cpu")
        if reason is not None:
            raise ValueError(f"the numpy engine cannot serve this model: {reason}")
        self.source = model
        self._discrete = isinstance(model.head, CategoricalHead)
        self._action_shape = model.spec.action_shape
        self._rng = np.random.default_rng(seed)
        self._rows = np.arange(0)
        self.refresh()

    def refresh(self) -> None:
        """Re-read the source model's weights (call after every weight update)."""
        actor, critic = _layers(self.source.actor), _layers(self.source.critic)
        (wa, ba, act_a), (wc, bc, act_c) = actor[0], critic[0]
        self._first = (np.concatenate([wa, wc], 1), np.concatenate([ba, bc]))
        self._first_act = (act_a, act_c)
        self._split = wa.shape[1]
        self._actor, self._critic = actor[1:], critic[1:]
        if not self._discrete:
            self._log_std = self.source.head.log_std.detach().cpu().numpy().astype(np.float64)

    def _activate(self, x: np.ndarray, activation: str | None) -> np.ndarray:
        if activation == "tanh":
            np.tanh(x, out=x)
        elif activation == "relu":
            np.maximum(x, 0.0, out=x)
        return x

    def act(self, inputs: dict[str, Any], modes: Any = None) -> dict[str, np.ndarray]:
        obs = inputs["observation"]
        obs = obs.numpy() if isinstance(obs, torch.Tensor) else np.asarray(obs)
        n = obs.shape[0]
        if self._rows.shape[0] < n:
            self._rows = np.arange(max(n, 256))
        x = obs.reshape(n, -1).astype(np.float32, copy=False)
        weight, bias = self._first
        h = x @ weight
        h += bias
        ha = self._activate(h[:, : self._split], self._first_act[0])
        hc = self._activate(h[:, self._split :], self._first_act[1])
        params = _apply(ha, self._actor)
        value = _apply(hc, self._critic)[:, 0]
        greedy = None
        if modes is not None:
            m = modes.numpy() if isinstance(modes, torch.Tensor) else np.asarray(modes)
            greedy = m != int(InteractionMode.RANDOM)
            if not greedy.any():
                greedy = None
        if self._discrete:
            z = params - params.max(1, keepdims=True)
            log_probs = z - np.log(np.exp(z).sum(1, keepdims=True))
            # Gumbel-max: argmax(logp + Gumbel) = argmax(logp - log(Exp(1))).
            action = (log_probs - np.log(self._rng.exponential(size=log_probs.shape))).argmax(1)
            if greedy is not None:
                action = np.where(greedy, log_probs.argmax(1), action)
            log_prob = log_probs[self._rows[:n], action]
            action = action.astype(np.int64, copy=False)
        else:
            std = np.exp(self._log_std)
            action = params + std * self._rng.standard_normal(params.shape)
            if greedy is not None:
                action = np.where(greedy[:, None], params, action)
            log_prob = (-((action - params) ** 2) / (2 * std**2) - self._log_std - 0.5 * np.log(2 * np.pi)).sum(1)
            action = action.astype(np.float32).reshape(n, *self._action_shape)
        return {
            "action": action,
            "sample_log_prob": log_prob.astype(np.float32, copy=False),
            "state_value": np.ascontiguousarray(value, dtype=np.float32),
        }


def serving_engine(
    model: Any, engine: str, device: str = "cpu", output_device: str = "cpu", seed: int | None = None
) -> Any:
    """The engine whose ``act`` the server calls (``.name`` says which)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown serving engine {engine!r} (allowed: {', '.join(ENGINES)})")
    if engine != "torch":
        reason = numpy_eligible(model, device)
        if reason is None:
            return NumpyActorCritic(model, seed)
        if engine == "numpy":
            raise ValueError(f"server.engine=numpy: {reason}")
    if not isinstance(model, torch.nn.Module):  # e.g. a relay: already an engine
        return model
    return TorchEngine(model, device, output_device)
