"""Policy weights shared with an inference process, stamped with a version.

The trainer publishes into one shared arena under a process lock and bumps
``version``; the server polls ``version`` between batches (one shared
integer read) and copies the weights in under the same lock, so it never
sees half of an update. Weights published before the server started are
simply there when it first looks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from components.shm import FieldSpec, SharedArena


def _numpy_dtype(dtype: torch.dtype) -> str:
    return str(torch.empty((), dtype=dtype).numpy().dtype)


class SharedWeights:
    """A versioned copy of a state dict in shared memory.

    Examples:
        >>> w = SharedWeights({"a": torch.zeros(3)}, ctx=__import__("threading"))
        >>> w.publish({"a": torch.ones(3)})
        1
        >>> target = torch.nn.Module(); target.register_buffer("a", torch.zeros(3))
        >>> w.copy_into(target), target.a.tolist()
        (1, [1.0, 1.0, 1.0])
    """

    def __init__(self, template: Mapping[str, torch.Tensor], ctx: Any) -> None:
        fields = [FieldSpec("w." + k, tuple(v.shape), _numpy_dtype(v.dtype)) for k, v in template.items()]
        fields.append(FieldSpec("version", (1,), "int64"))
        self._arena = SharedArena(fields)
        self._keys = list(template.keys())
        self._lock = ctx.Lock()
        self._bind()

    def _bind(self) -> None:
        self._version = self._arena.array("version")
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
    def version(self) -> int:
        return int(self._version[0])

    def publish(self, weights: Mapping[str, torch.Tensor]) -> int:
        """Write a full state dict and bump the version; returns the new version."""
        views = self._views()
        missing = set(views) - set(weights)
        if missing:
            raise KeyError(f"weights lack {sorted(missing)}")
        with self._lock, torch.no_grad():
            for key, view in views.items():
                view.copy_(weights[key].detach().to("cpu"))
            self._version[0] += 1
            return int(self._version[0])

    def copy_into(self, model: torch.nn.Module) -> int:
        """Load the latest published weights into ``model``; returns their version."""
        views = self._views()
        with self._lock, torch.no_grad():
            own = model.state_dict()
            for key, view in views.items():
                own[key].copy_(view, non_blocking=True)
            return int(np.asarray(self._version[0]))


class CudaSharedWeights:
    """Weights on the policy's CUDA device, shared with a server process by CUDA IPC.

    When the served policy lives on a GPU, copying every update through host
    memory would cost two PCIe transfers; instead the driver owns one device
    copy of the state dict whose IPC handles the server process opens once
    (the tensors travel as ``Process`` arguments). Publishing is a
    device-to-device copy plus a version bump, under the same kind of process
    lock as :class:`SharedWeights`.
    """

    def __init__(self, template: Mapping[str, torch.Tensor], device: str, ctx: Any) -> None:
        import torch.multiprocessing  # noqa: F401 - registers the CUDA-IPC pickling of tensors

        self._tensors = {k: v.detach().to(device).clone() for k, v in template.items()}
        self._arena = SharedArena([FieldSpec("version", (1,), "int64")])
        self._lock = ctx.Lock()
        self._version = self._arena.array("version")

    def __getstate__(self) -> dict[str, Any]:
        return {"_tensors": self._tensors, "_arena": self._arena, "_lock": self._lock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._version = self._arena.array("version")

    @property
    def version(self) -> int:
        return int(self._version[0])

    def publish(self, weights: Mapping[str, torch.Tensor]) -> int:
        with self._lock, torch.no_grad():
            for key, tensor in self._tensors.items():
                tensor.copy_(weights[key].detach(), non_blocking=True)
            torch.cuda.current_stream(next(iter(self._tensors.values())).device).synchronize()
            self._version[0] += 1
            return int(self._version[0])

    def copy_into(self, model: torch.nn.Module) -> int:
        with self._lock, torch.no_grad():
            own = model.state_dict()
            for key, tensor in self._tensors.items():
                own[key].copy_(tensor, non_blocking=True)
            torch.cuda.current_stream(tensor.device).synchronize()
            return int(self._version[0])
