"""The transport interface between policy clients and an inference server.

A transport moves observation rows from clients to a server and actions
back. The server only ever talks to this small interface, so a thread queue,
fixed shared-memory slots or a test double, are interchangeable:

``wait_for_work`` -> ``drain`` (claim ready requests) -> ``gather`` (one
batch of inputs) -> model forward -> ``resolve`` (fan results back) or
``resolve_exception`` (fan the error back to exactly those requests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from components.obs_tree import ObsLeaf, model_observation
from components.shm import FieldSpec

#: Key under which every response row carries the behaviour-policy version.
POLICY_VERSION = "policy_version"


class InferenceError(RuntimeError):
    """Base class of errors a policy client can receive."""


class RemotePolicyError(InferenceError):
    """The served model raised while computing this request's batch."""


class ServerDiedError(InferenceError):
    """The inference server went away while a request was pending."""


class ServerStoppedError(InferenceError):
    """The server was shut down before it answered."""


@dataclass(frozen=True)
class Layout:
    """Per-row request and response fields (leading row dims excluded).

    Derived once from one env's observation spec and one policy pass, then
    used to allocate every shared bank.
    """

    request: tuple[FieldSpec, ...]
    response: tuple[FieldSpec, ...]

    @property
    def request_keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.request)

    @property
    def response_keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.response)

    @property
    def state(self) -> tuple[FieldSpec, ...]:
        """A recurrent policy's request fields that a chunk records per step: its state leaves (those that come
        back as ``next.<leaf>``) and the episode-start flag; empty for a feed-forward policy."""
        from components.recurrent_state import IS_FIRST

        keys = set(self.response_keys)
        carried = tuple(f for f in self.request if f"next.{f.name}" in keys)
        return (*carried, *(f for f in self.request if f.name == IS_FIRST)) if carried else ()


def derive_layout(model: Any, observation: FieldSpec, example: Any = None, obs_leaves: Sequence[ObsLeaf] = ()) -> Layout:
    """Request fields from the observation spec, response fields from one ``act`` pass.

    A model that samples with env-side noise (``action_noise_width``, see
    :mod:`components.action_noise`) gets its request field too.

    ``example``: one observation the model can take (zeros when None; a
    categorical space whose categories start above 0 needs its own).
    ``obs_leaves``: a Dict/Tuple observation's leaves: the model reads the
    packed rows as a nested ``TensorDict``, as the server hands them over.
    """
    import numpy as np
    import torch

    from components.action_noise import NOISE_KEY, noise_width

    from components.recurrent import IS_FIRST, state_leaves, zero_state
    from components.recurrent_state import state_fields

    in_keys = tuple(getattr(model, "in_keys", ("observation",)))
    if in_keys != (observation.name,):
        raise ValueError(f"model inputs {in_keys} do not match the env's {observation.name!r}")
    first = np.zeros(observation.shape, observation.dtype) if example is None else np.asarray(example, observation.dtype)
    probe = torch.from_numpy(np.broadcast_to(first, (2, *observation.shape)).copy())
    reference = next(iter([*model.parameters(), *model.buffers()]), None)
    device = reference.device if reference is not None else torch.device("cpu")
    leaves = state_leaves(model)
    inputs = {observation.name: model_observation(obs_leaves, probe.to(device))}
    if leaves:  # a recurrent model: its state leaves and the episode-start flag travel with every request
        inputs.update(zero_state(model, 2, device))
        inputs[IS_FIRST] = torch.ones(2, dtype=torch.bool, device=device)
    with torch.no_grad():
        out = model.act(inputs, torch.zeros(2, dtype=torch.int8, device=device))
    response = [
        FieldSpec(key, tuple(value.shape[1:]), str(value.dtype).removeprefix("torch."))
        for key, value in out.items()
    ]
    response.append(FieldSpec(POLICY_VERSION, (), "int64"))
    width = noise_width(model)
    request = [observation] if not width else [observation, FieldSpec(NOISE_KEY, (width,), "float32")]
    request += state_fields(leaves)
    return Layout(tuple(request), tuple(response))


class Pending(NamedTuple):
    """One claimed request: its transport handle, observation rows, submit time."""

    handle: Any
    rows: int
    submitted_at: float


class InferenceTransport(ABC):
    """Server-side view of a transport; clients come from :meth:`client`."""

    layout: Layout

    @abstractmethod
    def client(self) -> Any:
        """A client for one requester (a worker, a thread, a test)."""

    @abstractmethod
    def wait_for_work(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until a request may be ready; True if one is."""

    @abstractmethod
    def drain(self, max_rows: int) -> list[Pending]:
        """Claim ready requests, whole ones, up to ``max_rows`` rows (at least one request)."""

    @abstractmethod
    def gather(self, requests: Sequence[Pending]) -> tuple[dict[str, Any], Any]:
        """One batch of inputs (tensors keyed by request field) and per-row mode codes."""

    @abstractmethod
    def resolve(self, requests: Sequence[Pending], outputs: dict[str, Any]) -> None:
        """Hand each request its rows of ``outputs`` and wake its owner."""

    @abstractmethod
    def resolve_exception(self, requests: Sequence[Pending], exc: BaseException) -> None:
        """Deliver ``exc`` to the owners of exactly these requests."""

    def close(self) -> None:
        """Fail what is still queued; later submissions raise."""
