"""A remote policy that looks local: TensorDict in, TensorDict of actions out.

:class:`PolicyClient` is for code outside the collector's hot path (an
evaluation loop, a notebook, a test): it owns one or more slots of a
:class:`~components.inference.slots.SlotTransport` and behaves like a
TensorDict policy. ``client(td)`` returns the policy's outputs,
``client.submit(td)`` a future. Every request carries its interaction mode;
the number of slots bounds the requests in flight. Env workers do not use
it: they write straight into their slot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from components.inference.slots import SlotClient, SlotFuture
from components.interaction import InteractionMode


class PolicyClient:
    """A remote policy with the call signature of a local TensorDict policy.

    Args:
        clients: one slot client, or several (then up to that many requests
            are in flight; a further ``submit`` first collects the oldest).
        in_keys: keys of the request TensorDict sent to the server.
        interaction_mode: mode stamped on every request unless ``submit`` is
            given another ("random" explores, "mode"/"deterministic" act
            greedily). It is never read from global state.

    Examples:
        >>> import threading
        >>> from tensordict import TensorDict
        >>> from components.envs import EnvSpec
        >>> from components.models import ModelSpec
        >>> from components.inference.server import InferenceServer
        >>> from components.inference.slots import SlotTransport
        >>> from components.inference.transport import derive_layout
        >>> spec = EnvSpec((4,), "float32", "discrete", action_n=2)
        >>> model = ModelSpec("components.models.ActorCritic")
        >>> transport = SlotTransport(derive_layout(model.build(spec), spec.observation_field()),
        ...                           num_slots=2, rows_per_slot=5, ctx=threading)
        >>> policy = PolicyClient([transport.client(), transport.client()])
        >>> with InferenceServer(model, transport, env_spec=spec):
        ...     out = policy(TensorDict({"observation": torch.zeros(5, 4)}, batch_size=[5]))
        >>> out["action"].shape, out["policy_version"].tolist()
        (torch.Size([5]), [0, 0, 0, 0, 0])
    """

    def __init__(
        self,
        clients: SlotClient | Sequence[SlotClient],
        *,
        in_keys: tuple[str, ...] = ("observation",),
        interaction_mode: Any = InteractionMode.RANDOM,
    ) -> None:
        self._free: deque[SlotClient] = deque([clients] if isinstance(clients, SlotClient) else clients)
        if not self._free:
            raise ValueError("a PolicyClient needs at least one slot client")
        self.max_inflight = len(self._free)
        self.in_keys = tuple(in_keys)
        self.interaction_mode = InteractionMode.parse(interaction_mode)
        self._inflight: deque[tuple[SlotClient, SlotFuture]] = deque()

    def submit_tensors(self, inputs: dict[str, Any], interaction_mode: Any = None) -> SlotFuture:
        """Low-level submit: a dict of CPU tensors or arrays in, a future of numpy arrays out."""
        mode = int(InteractionMode.parse(interaction_mode if interaction_mode is not None else self.interaction_mode))
        if not self._free:
            # Every slot is busy: collect the oldest request (its future keeps the copy).
            client, future = self._inflight.popleft()
            future.result()
            self._free.append(client)
        while self._inflight and self._inflight[0][1].done():
            self._free.append(self._inflight.popleft()[0])
        client = self._free.popleft()
        try:
            future = client.submit_inputs(inputs, mode)
        except BaseException:
            self._free.appendleft(client)
            raise
        self._inflight.append((client, future))
        return future

    def submit(self, td: Any, interaction_mode: Any = None) -> _TensorDictFuture:
        """Send ``td``'s ``in_keys``; the future's result is a TensorDict of outputs."""
        future = self.submit_tensors({key: td.get(key) for key in self.in_keys}, interaction_mode)
        return _TensorDictFuture(future, list(td.batch_size))

    def __call__(self, td: Any, interaction_mode: Any = None) -> Any:
        return self.submit(td, interaction_mode).result()


class _TensorDictFuture:
    """Wraps a slot future so its result is a TensorDict of tensors."""

    def __init__(self, inner: SlotFuture, batch_size: list[int]) -> None:
        self._inner, self._batch_size = inner, batch_size

    def done(self) -> bool:
        return self._inner.done()

    def result(self, timeout: float | None = None) -> Any:
        from tensordict import TensorDict

        raw = self._inner.result(timeout)
        tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in raw.items()}
        return TensorDict(tensors, batch_size=self._batch_size)
