"""Client side of the inference service: a remote policy that looks local.

:class:`PolicyClient` wraps any transport client (thread queue or shared
slot) and behaves like a TensorDict policy: ``client(td)`` returns a
TensorDict of the policy's outputs, ``client.submit(td)`` a future. Every
request carries its interaction mode; an in-flight bound (``max_inflight``)
keeps a fast producer from flooding the server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np
import torch

from components.interaction import InteractionMode


class _GuardedFuture:
    """Frees an in-flight permit exactly once, when the request completes.

    A ``result(timeout)`` that times out keeps the permit: the request is
    still being served, and releasing early would let more than
    ``max_inflight`` requests be in flight.
    """

    def __init__(self, inner: Any, release: Callable[[], None], convert: Callable[[Any], Any]) -> None:
        self._inner, self._release, self._convert = inner, release, convert
        self._released = False
        self._lock = threading.Lock()
        self._value: Any = None
        self._has_value = False
        add_done_callback = getattr(inner, "add_done_callback", None)
        if add_done_callback is not None:
            add_done_callback(lambda _f: self._release_once())

    def _release_once(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release()

    def done(self) -> bool:
        done = bool(self._inner.done())
        if done and not hasattr(self._inner, "add_done_callback"):
            self._release_once()
        return done

    def result(self, timeout: float | None = None) -> Any:
        if self._has_value:
            return self._value
        try:
            raw = self._inner.result(timeout)
        except (FutureTimeout, TimeoutError):
            raise TimeoutError(f"no response within {timeout} s") from None
        except BaseException:
            self._release_once()
            raise
        self._release_once()
        self._value, self._has_value = self._convert(raw), True
        return self._value

    def __del__(self) -> None:
        # Last resort for an abandoned pull-based future: never leak a permit.
        try:
            if not self._released and self.done():
                self._release_once()
        except Exception:  # noqa: BLE001
            pass


def _as_tensors(raw: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in raw.items()}


class PolicyClient:
    """A remote policy with the call signature of a local TensorDict policy.

    Args:
        client: a transport client (``ThreadTransport.client()`` or a
            ``SlotTransport`` client).
        in_keys: keys of the request TensorDict sent to the server.
        max_inflight: most unanswered requests at once; ``submit`` blocks
            for a permit beyond that. ``None`` disables the bound.
        interaction_mode: mode stamped on every request unless ``submit``
            is given another one ("random" explores, "mode"/"deterministic"
            act greedily). It is never read from global state.

    Examples:
        >>> from tensordict import TensorDict
        >>> from components.envs import EnvSpec
        >>> from components.models import ActorCritic
        >>> from components.inference.server import InferenceServer
        >>> from components.inference.thread_transport import ThreadTransport
        >>> transport = ThreadTransport()
        >>> model = ActorCritic(EnvSpec((4,), "float32", "discrete", action_n=2))
        >>> with InferenceServer(model, transport):
        ...     policy = PolicyClient(transport.client(), max_inflight=2)
        ...     out = policy(TensorDict({"observation": torch.zeros(5, 4)}, batch_size=[5]))
        >>> out["action"].shape
        torch.Size([5])
    """

    def __init__(
        self,
        client: Any,
        *,
        in_keys: tuple[str, ...] = ("observation",),
        max_inflight: int | None = None,
        interaction_mode: Any = InteractionMode.RANDOM,
    ) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1 or None, got {max_inflight}")
        self.client = client
        self.in_keys = tuple(in_keys)
        self.max_inflight = max_inflight
        self.interaction_mode = InteractionMode.parse(interaction_mode)
        self._permits = threading.BoundedSemaphore(max_inflight) if max_inflight else None

    def _submit_raw(self, inputs: dict[str, Any], mode: Any) -> tuple[Any, Callable[[], None]]:
        code = int(InteractionMode.parse(mode if mode is not None else self.interaction_mode))
        release: Callable[[], None] = self._permits.release if self._permits else (lambda: None)
        if self._permits is not None:
            self._permits.acquire()
        try:
            submit = getattr(self.client, "submit_inputs", None) or self.client.submit
            return submit(inputs, code), release
        except BaseException:
            release()
            raise

    def submit_tensors(self, inputs: dict[str, torch.Tensor], interaction_mode: Any = None) -> _GuardedFuture:
        """Low-level submit: a dict of tensors in, a future of a dict of tensors out."""
        inner, release = self._submit_raw(inputs, interaction_mode)
        return _GuardedFuture(inner, release, _as_tensors)

    def submit(self, td: Any, interaction_mode: Any = None) -> _GuardedFuture:
        """Send ``td``'s ``in_keys``; the future's result is a TensorDict of outputs."""
        from tensordict import TensorDict

        inputs = {key: td.get(key) for key in self.in_keys}
        inner, release = self._submit_raw(inputs, interaction_mode)
        batch = list(td.batch_size)

        def convert(raw: dict[str, Any]) -> Any:
            return TensorDict(_as_tensors(raw), batch_size=batch)

        return _GuardedFuture(inner, release, convert)

    def __call__(self, td: Any, interaction_mode: Any = None) -> Any:
        return self.submit(td, interaction_mode).result()


class FutureChannel:
    """A worker's action channel over a :class:`PolicyClient` (thread workers).

    The worker writes its observation block into :attr:`request` (private
    arrays, shared with the torch tensors that travel in the request).
    """

    def __init__(self, policy: PolicyClient, request_fields: Any, rows: int) -> None:
        self._policy = policy
        self.request = {f.name: np.zeros((rows, *f.shape), f.dtype) for f in request_fields}
        self._tensors = {k: torch.from_numpy(v) for k, v in self.request.items()}
        self._future: _GuardedFuture | None = None

    def submit(self, rows: int | None = None, mode: int | None = None) -> None:
        inputs = {k: (v if rows is None else v[:rows]) for k, v in self._tensors.items()}
        self._future = self._policy.submit_tensors(inputs, mode)

    def wait(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        if self._future is None:
            raise RuntimeError("wait() without a submitted request")
        result = self._future.result(timeout)
        self._future = None
        return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in result.items()}
