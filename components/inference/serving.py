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

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from components.kinds import EngineKind
from components.inference.numpy_engine import NumpyActorCriticEngine, NumpyQNetworkEngine
from components.models import ActorCritic, CategoricalHead, GaussianHead, QNetwork
from components.obs_tree import ObsLeaf, model_observation

ENGINES = EngineKind.words()


class TorchEngine:
    """Serves ``model.act`` with torch; on CUDA through pinned host staging.

    Accepts numpy or torch inputs (shared-slot transports hand over numpy
    views of their banks). With the policy on CUDA, inputs are copied into
    pinned host buffers and sent to the device without blocking, and the
    outputs come back into pinned host buffers with one copy per leaf and
    one event wait per batch (no device-wide synchronisation).
    ``static_batch_size`` pads every batch to that many rows and replays a
    CUDA graph captured on first use, removing per-op launch costs.
    ``obs_leaves``: a Dict/Tuple observation's leaves; the packed rows the
    slots hold reach the model as a nested ``TensorDict`` of leaf views
    (:func:`~components.obs_tree.model_observation`), as batches reach the
    trainer.
    """

    name = "torch"

    def __init__(self, model: Any, device: str = "cpu", output_device: str = "cpu",
                 static_batch_size: int | None = None, obs_leaves: Sequence[ObsLeaf] = ()) -> None:
        self.model = model
        self._leaves = tuple(obs_leaves)
        self._device = torch.device(device)
        self._output_device = torch.device(output_device)
        self._cuda = self._device.type == "cuda"
        self._pinned: dict[str, torch.Tensor] = {}
        self._static_batch = static_batch_size if self._cuda else None
        self._graph: Any = None
        self._static_in: dict[str, torch.Tensor] = {}
        self._static_out: dict[str, torch.Tensor] = {}

    def _stage(self, key: str, value: Any) -> torch.Tensor:
        """Copy ``value`` into a pinned host buffer (grown as needed) and return the filled part."""
        value = torch.as_tensor(value)
        buf = self._pinned.get(key)
        if buf is None or buf.shape[0] < value.shape[0] or buf.shape[1:] != value.shape[1:] or buf.dtype != value.dtype:
            rows = max(value.shape[0], self._static_batch or 0, 1)
            buf = torch.empty((rows, *value.shape[1:]), dtype=value.dtype, pin_memory=True)
            self._pinned[key] = buf
        part = buf[: value.shape[0]]
        part.copy_(value)
        return part

    def act(self, inputs: dict[str, Any], modes: Any) -> dict[str, torch.Tensor]:
        if not self._cuda:
            tensors = {k: torch.as_tensor(v) for k, v in inputs.items()}
            with torch.no_grad():
                out = self._act(tensors, torch.as_tensor(modes))
            if self._device != self._output_device:
                out = {k: v.to(self._output_device) for k, v in out.items()}
            return out
        n = int(modes.shape[0])
        device_in = {k: self._stage(k, v).to(self._device, non_blocking=True) for k, v in inputs.items()}
        device_modes = self._stage("__modes__", modes).to(self._device, non_blocking=True)
        with torch.no_grad():
            if self._static_batch is not None and n <= self._static_batch:
                out = self._replay(device_in, device_modes, n)
            else:
                out = self._act(device_in, device_modes)
        host = {}
        for key, value in out.items():
            buf = self._pinned_out(key, value, n)
            buf.copy_(value[:n], non_blocking=True)
            host[key] = buf
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host

    def _act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor) -> dict[str, torch.Tensor]:
        if self._leaves:  # views of the packed rows (in a captured graph: of its static input buffer)
            inputs = {**inputs, "observation": model_observation(self._leaves, inputs["observation"])}
        return self.model.act(inputs, modes)

    def _pinned_out(self, key: str, value: torch.Tensor, n: int) -> torch.Tensor:
        name = "__out__" + key
        buf = self._pinned.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1:] != value.shape[1:] or buf.dtype != value.dtype:
            buf = torch.empty((max(n, self._static_batch or 0), *value.shape[1:]), dtype=value.dtype, pin_memory=True)
            self._pinned[name] = buf
        return buf[:n]

    def _replay(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
        """Run the captured graph on ``inputs`` padded to the static batch size."""
        if self._graph is None:
            self._capture(inputs, modes)
        for key, value in inputs.items():
            self._static_in[key][:n].copy_(value)
        self._static_in["__modes__"][:n].copy_(modes)
        self._graph.replay()
        return {k: v[:n] for k, v in self._static_out.items()}

    def _capture(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor) -> None:
        size = int(self._static_batch)
        self._static_in = {k: torch.zeros((size, *v.shape[1:]), dtype=v.dtype, device=self._device)
                           for k, v in inputs.items()}
        self._static_in["__modes__"] = torch.zeros(size, dtype=modes.dtype, device=self._device)
        static_inputs = {k: v for k, v in self._static_in.items() if k != "__modes__"}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph, as CUDA graphs require
            for _ in range(3):
                self._act(static_inputs, self._static_in["__modes__"])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._static_out = self._act(static_inputs, self._static_in["__modes__"])
        self._graph = graph

    def refresh(self) -> None:
        """Nothing to do: weights are copied into the model's own tensors, which the graph reads."""


def numpy_eligible(model: Any, device: str) -> str | None:
    """Why ``model`` cannot be served by the numpy engine, or None if it can."""
    if str(device) != "cpu":
        return f"the policy runs on {device}"
    if not isinstance(model, (ActorCritic, QNetwork)):
        return f"{type(model).__name__} has no numpy engine"
    if model.shared is not None:
        return "only MLP encoders have a numpy engine"
    if model.spec.is_tree:
        return "Dict/Tuple observations have no numpy engine"
    if model.spec.categorical_obs:
        return "categorical (one-hot encoded) observations have no numpy engine"
    if isinstance(model, ActorCritic) and not isinstance(model.head, (CategoricalHead, GaussianHead)):
        return f"{model.spec.action_kind} actions have no numpy engine"
    nets = (model.actor, model.critic) if isinstance(model, ActorCritic) else (model.head,)
    for net in nets:
        for layer in net.modules():
            if isinstance(layer, (nn.Sequential, nn.Linear, nn.Tanh, nn.ReLU)):
                continue
            return f"layer {type(layer).__name__} has no numpy equivalent"
    return None


def _layer_keys(net: nn.Module, prefix: str) -> list[tuple[str, str, str | None]]:
    """(weight key, bias key, activation after it) of each Linear of ``net``, in order."""
    keys: list[tuple[str, str, str | None]] = []
    for name, module in net.named_modules():
        if isinstance(module, nn.Linear):
            path = f"{prefix}.{name}" if name else prefix
            keys.append((f"{path}.weight", f"{path}.bias", None))
        elif isinstance(module, (nn.Tanh, nn.ReLU)):
            w, b, _ = keys[-1]
            keys[-1] = (w, b, "tanh" if isinstance(module, nn.Tanh) else "relu")
    return keys


def numpy_recipe(model: Any) -> dict[str, Any]:
    """What the numpy engine needs to rebuild ``model`` from its state dict (picklable, no torch).

    Raises ValueError when ``model`` has no numpy engine (see :func:`numpy_eligible`).
    """
    reason = numpy_eligible(model, "cpu")
    if reason is not None:
        raise ValueError(f"the numpy engine cannot serve this model: {reason}")
    if isinstance(model, QNetwork):
        return {"kind": "q", "head": _layer_keys(model.head, "head"), "epsilon": "epsilon",
                "action_n": int(model.spec.action_n)}
    discrete = isinstance(model.head, CategoricalHead)
    norm = getattr(model, "obs_norm", None)
    return {
        "kind": "actor_critic", "discrete": discrete, "action_shape": tuple(model.spec.action_shape),
        "actor": _layer_keys(model.actor, "actor"), "critic": _layer_keys(model.critic, "critic"),
        "log_std": None if discrete else "head.log_std",
        "norm": None if norm is None else {"mean": "obs_norm.mean", "var": "obs_norm.var", "eps": norm.eps,
                                          "clip": norm.clip},
    }


def numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    """``model``'s state dict as numpy arrays (views of its CPU tensors)."""
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


class NumpyActorCritic(NumpyActorCriticEngine):
    """The numpy engine of an MLP :class:`ActorCritic`, reading the weights from the module itself.

    Returns numpy arrays (which shared-slot transports copy straight into
    their banks); :meth:`refresh` re-reads the module after a weight update.

    Examples:
        >>> from components.envs import EnvSpec
        >>> model = ActorCritic(EnvSpec((4,), "float32", "discrete", action_n=2))
        >>> engine = NumpyActorCritic(model, seed=0)
        >>> out = engine.act({"observation": np.zeros((3, 4), np.float32)}, np.ones(3, np.int8))
        >>> ref = model.act({"observation": torch.zeros(3, 4)}, torch.ones(3, dtype=torch.int8))
        >>> out["action"].tolist() == ref["action"].tolist()
        True
    """

    def __init__(self, model: ActorCritic, seed: int | None = None) -> None:
        self.source = model
        super().__init__(numpy_recipe(model), lambda: numpy_state(model), seed)


class NumpyQNetwork(NumpyQNetworkEngine):
    """The numpy engine of an MLP :class:`QNetwork`: greedy or epsilon-greedy per row.

    Examples:
        >>> from components.envs import EnvSpec
        >>> net = QNetwork(EnvSpec((4,), "float32", "discrete", action_n=2), hidden=(8,))
        >>> engine = NumpyQNetwork(net, seed=0)
        >>> out = engine.act({"observation": np.zeros((3, 4), np.float32)}, np.ones(3, np.int8))
        >>> out["action"].tolist() == net(torch.zeros(3, 4)).argmax(-1).tolist()
        True
    """

    def __init__(self, model: QNetwork, seed: int | None = None) -> None:
        self.source = model
        super().__init__(numpy_recipe(model), lambda: numpy_state(model), seed)


def serving_engine(
    model: Any, engine: str, device: str = "cpu", output_device: str = "cpu", seed: int | None = None,
    static_batch_size: int | None = None, obs_leaves: Sequence[ObsLeaf] = (),
) -> Any:
    """The engine whose ``act`` the server calls (``.name`` says which).

    ``obs_leaves``: a Dict/Tuple observation's leaves (see :class:`TorchEngine`).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown serving engine {engine!r} (allowed: {', '.join(ENGINES)})")
    if engine != "torch":
        reason = numpy_eligible(model, device)
        if reason is None:
            return NumpyActorCritic(model, seed) if isinstance(model, ActorCritic) else NumpyQNetwork(model, seed)
        if engine == "numpy":
            raise ValueError(f"server.engine=numpy: {reason}")
    if not isinstance(model, torch.nn.Module):  # an object with its own act(): served as is
        return model
    return TorchEngine(model, device, output_device, static_batch_size, obs_leaves)
