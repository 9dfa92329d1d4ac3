"""Policy weights shared with an inference server, labelled with the trainer's version.

The trainer publishes into one shared arena under a lock: the tensors, the
``version`` label it chose (the trainer owns the policy version; 0 is the
initial weights) and a publish counter ``seq``. The server polls ``seq``
between batches (one shared integer read) and copies the weights in under
the same lock, so it never sees half of an update. Why a counter besides
the label: the initial weights are published with version 0, the version a
server already starts at; only the counter tells the server they are new.
The same object serves a server thread (``ctx=threading``) and a server
process (a ``spawn`` context), so both placements take weights one way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from components.inference.weights_reader import WeightsReader
from components.shm import FieldSpec, SharedArena


def _numpy_dtype(dtype: torch.dtype) -> str:
    return str(torch.empty((), dtype=dtype).numpy().dtype)


#: How long a publish waits for the lock. The server holds it only to copy the weights in
#: (micro- to milliseconds); longer means it was killed while holding it.
PUBLISH_LOCK_TIMEOUT_S = 10.0


class WeightsLockError(RuntimeError):
    """The weights lock was not released: the inference server died while it read weights."""


def _acquire(lock: Any) -> None:
    if not lock.acquire(True, PUBLISH_LOCK_TIMEOUT_S):
        raise WeightsLockError(f"the policy weights stayed locked for {PUBLISH_LOCK_TIMEOUT_S:g} s: the inference "
                               "server died while it was reading them")


def state_of(weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The state dict of a module, or the mapping itself."""
    return weights.state_dict() if isinstance(weights, torch.nn.Module) else weights


class SharedWeights:
    """A versioned copy of a state dict in shared host memory.

    Examples:
        >>> w = SharedWeights({"a": torch.zeros(3)}, ctx=__import__("threading"))
        >>> w.publish({"a": torch.ones(3)}, version=0)
        1
        >>> target = torch.nn.Module(); target.register_buffer("a", torch.zeros(3))
        >>> w.copy_into(target), target.a.tolist()
        ((0, 1), [1.0, 1.0, 1.0])
    """

    def __init__(self, template: Mapping[str, torch.Tensor], ctx: Any) -> None:
        fields = [FieldSpec("w." + k, tuple(v.shape), _numpy_dtype(v.dtype)) for k, v in template.items()]
        fields += [FieldSpec("seq", (1,), "int64"), FieldSpec("version", (1,), "int64"),
                   FieldSpec("writing", (1,), "int64")]
        self._arena = SharedArena(fields)
        self._keys = list(template.keys())
        self._lock = ctx.Lock()
        self._bind()

    def _bind(self) -> None:
        self._seq = self._arena.array("seq")
        self._version = self._arena.array("version")
        self._writing = self._arena.array("writing")
        self._tensors: dict[str, torch.Tensor] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_arena": self._arena, "_keys": self._keys, "_lock": self._lock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def _views(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = {k: self._arena.tensor("w." + k) for k in self._keys}
        return self._tensors

    @property
    def seq(self) -> int:
        """How many times weights were published (0: never)."""
        return int(self._seq[0])

    @property
    def version(self) -> int:
        """The version label of the latest published weights."""
        return int(self._version[0])

    def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> int:
        """Write a full state dict labelled ``version``; returns the publish count."""
        views = self._views()
        missing = set(views) - set(weights)
        if missing:
            raise KeyError(f"weights lack {sorted(missing)}")
        _acquire(self._lock)
        try:
            self._writing[0] = 1  # lock-free readers (read_into) retry while this is set
            with torch.no_grad():
                for key, view in views.items():
                    view.copy_(weights[key].detach().to("cpu"))
            self._version[0] = int(version)
            self._seq[0] += 1
            self._writing[0] = 0
            return int(self._seq[0])
        finally:
            self._lock.release()

    def snapshot(self, timeout: float = 2.0) -> tuple[dict[str, torch.Tensor], int, int]:
        """A copy of the latest published weights with their (version, seq), to re-publish elsewhere.

        Taken under the lock when it can be had within ``timeout``; a server
        process killed while it held the lock (it only reads) would keep it
        forever, and the arena is consistent then, so it is read without.
        """
        locked = self._lock.acquire(True, timeout)
        try:
            state = {k: v.clone() for k, v in self._views().items()}
            return state, int(self._version[0]), int(self._seq[0])
        finally:
            if locked:
                self._lock.release()

    def copy_into(self, model: torch.nn.Module) -> tuple[int, int]:
        """Load the latest published weights into ``model``; returns their (version, seq)."""
        views = self._views()
        with self._lock, torch.no_grad():
            own = model.state_dict()
            for key, view in views.items():
                own[key].copy_(view, non_blocking=True)
            return int(self._version[0]), int(self._seq[0])


    def reader(self) -> WeightsReader:
        """A torch-free, lock-free reader of these weights (see :mod:`components.inference.weights_reader`)."""
        return WeightsReader(self._arena, self._keys)

    def read_into(self, model: torch.nn.Module, give_up_s: float = 0.05) -> tuple[int, int] | None:
        """Like :meth:`copy_into`, without the lock; None when no clean copy could be taken in ``give_up_s``.

        For readers that may be killed at any instant (env workers with the
        policy inline): a reader killed inside :meth:`copy_into` would hold
        the lock forever and stop every other reader and the trainer. The
        caller keeps its weights and tries again at its next step.
        """
        got = self.reader().read(give_up_s=give_up_s)
        if got is None:
            return None
        arrays, version, seq = got
        with torch.no_grad():
            own = model.state_dict()
            for key, value in arrays.items():
                own[key].copy_(torch.from_numpy(value))
        return version, seq


class CudaSharedWeights:
    """Weights on the policy's CUDA device, shared with a server process by CUDA IPC.

    When the served policy lives on a GPU, copying every update through host
    memory would cost two PCIe transfers; instead the driver owns one device
    copy of the state dict whose IPC handles the server process opens once
    (the tensors travel as ``Process`` arguments). Publishing is a
    device-to-device copy plus the version label and counter, under the same
    kind of lock as :class:`SharedWeights`.
    """

    def __init__(self, template: Mapping[str, torch.Tensor], device: str, ctx: Any) -> None:
        import torch.multiprocessing  # noqa: F401 - registers the CUDA-IPC pickling of tensors

        self._tensors = {k: v.detach().to(device).clone() for k, v in template.items()}
        self._arena = SharedArena([FieldSpec("seq", (1,), "int64"), FieldSpec("version", (1,), "int64")])
        self._lock = ctx.Lock()
        self._bind()

    def _bind(self) -> None:
        self._seq = self._arena.array("seq")
        self._version = self._arena.array("version")

    def __getstate__(self) -> dict[str, Any]:
        return {"_tensors": self._tensors, "_arena": self._arena, "_lock": self._lock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    @property
    def seq(self) -> int:
        return int(self._seq[0])

    @property
    def version(self) -> int:
        return int(self._version[0])

    def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> int:
        _acquire(self._lock)
        try:
            with torch.no_grad():
                for key, tensor in self._tensors.items():
                    tensor.copy_(weights[key].detach(), non_blocking=True)
            torch.cuda.current_stream(next(iter(self._tensors.values())).device).synchronize()
            self._version[0] = int(version)
            self._seq[0] += 1
            return int(self._seq[0])
        finally:
            self._lock.release()

    def snapshot(self, timeout: float = 2.0) -> tuple[dict[str, torch.Tensor], int, int]:
        """As :meth:`SharedWeights.snapshot`."""
        locked = self._lock.acquire(True, timeout)
        try:
            state = {k: v.clone() for k, v in self._tensors.items()}
            return state, int(self._version[0]), int(self._seq[0])
        finally:
            if locked:
                self._lock.release()

    def copy_into(self, model: torch.nn.Module) -> tuple[int, int]:
        with self._lock, torch.no_grad():
            own = model.state_dict()
            for key, tensor in self._tensors.items():
                own[key].copy_(tensor, non_blocking=True)
            torch.cuda.current_stream(tensor.device).synchronize()
            return int(self._version[0]), int(self._seq[0])


def shared_weights(template: Mapping[str, torch.Tensor], device: str, ctx: Any) -> SharedWeights | CudaSharedWeights:
    """The weight channel for a policy on ``device`` (CUDA IPC on a GPU, shared host memory otherwise)."""
    if torch.device(device).type == "cuda":
        return CudaSharedWeights(template, device, ctx)
    return SharedWeights(template, ctx)
