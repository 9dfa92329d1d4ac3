"""A thread-safe replay buffer: uniform or proportional prioritized sampling over a storage.

Threading model: a collector's writer thread calls :meth:`ReplayBuffer.extend`
while the trainer calls :meth:`ReplayBuffer.sample` and
:meth:`ReplayBuffer.update_priorities` from another. One lock guards the
storage, the sum tree and the RNG. The work that needs no shared state
(validation, device moves, frame hashing) happens before the lock is taken;
inside it are only the copies into storage, index draws and the gather of the
sampled rows (which must not race with an overwrite of the same rows).

Why rejection sampling for the policy-age filter and invalid frame stacks:
both are rare in a healthy run (the buffer is FIFO, so stale and invalid rows
are the oldest few), so redrawing the rejected part of a batch is far cheaper
than maintaining a second index of eligible rows. A few redraw rounds are
followed by one exact pass over all rows, so a mostly-stale buffer still
samples correctly, and a buffer with nothing eligible fails with an error
that says why instead of spinning.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from components.replay.storage import Storage
from components.replay.sumtree import SumTree


def _numpy(values: Any, dtype: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=dtype).reshape(-1)


class ReplayBuffer:
    """Uniform or prioritized (proportional) experience replay, safe to extend and sample concurrently.

    Prioritized sampling draws item ``i`` with ``P(i) = p_i^alpha / sum_j p_j^alpha``
    and weights it by ``w_i = (N P(i))^-beta / max_j w_j``; ``beta`` grows
    linearly to 1 over ``beta_steps`` calls of :meth:`sample`. New items get
    the largest priority seen so far, so each is likely to be replayed once.
    Weights are computed from the unfiltered ``P(i)``, the usual convention.

    Args:
        storage: a :class:`~components.replay.storage.TensorStorage` or
            :class:`~components.replay.frames.FrameStackStorage`.
        sampler: ``"uniform"`` or ``"prioritized"``.
        alpha: how strongly priorities skew sampling (0: uniform).
        beta: the initial importance-sampling exponent.
        beta_steps: sample calls over which beta reaches 1.
        eps: added to ``|td error|`` so no item's priority is 0.
        max_policy_lag: with a ``policy_version`` passed to :meth:`sample`
            (the trainer's exact version, see
            :class:`components.trainers.base.Trainer`), only items at most
            ``max_policy_lag`` versions old are returned: an item stamped
            ``v`` has lag ``policy_version - v``, and items with
            ``v < policy_version - max_policy_lag`` are never returned
            (0: only data from the current weights).
        seed: seeds the buffer's own generator (part of :meth:`state_dict`).
        max_attempts: redraw rounds before the exact fallback pass.
        version_key: the stored field holding each item's policy version.

    Examples:
        >>> from components.replay.storage import TensorStorage
        >>> rb = ReplayBuffer(TensorStorage(100), sampler="prioritized", max_policy_lag=2, seed=0)
        >>> _ = rb.extend(TensorDict({"x": torch.arange(8.0), "policy_version": torch.arange(8) // 2}, [8]))
        >>> batch = rb.sample(16, policy_version=5)           # lag <= 2: versions >= 3, x in {6, 7}
        >>> sorted(set(batch["x"].tolist())), batch["weight"].dtype
        ([6.0, 7.0], torch.float32)
        >>> rb.update_priorities(batch["index"], torch.zeros(16))
        >>> rb.stats()["rejected_stale"] > 0
        True
    """

    def __init__(
        self,
        storage: Storage,
        *,
        sampler: Literal["uniform", "prioritized"] = "uniform",
        alpha: float = 0.6,
        beta: float = 0.4,
        beta_steps: int = 100_000,
        eps: float = 1e-6,
        max_policy_lag: int | None = None,
        seed: int = 0,
        max_attempts: int = 8,
        version_key: str = "policy_version",
    ) -> None:
        if sampler not in ("uniform", "prioritized"):
            raise ValueError(f"sampler must be 'uniform' or 'prioritized', got {sampler!r}")
        if alpha < 0 or not 0 <= beta <= 1 or beta_steps < 1 or eps <= 0:
            raise ValueError(f"need alpha >= 0, 0 <= beta <= 1, beta_steps >= 1, eps > 0; got "
                             f"alpha={alpha}, beta={beta}, beta_steps={beta_steps}, eps={eps}")
        if max_policy_lag is not None and max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0 or None, got {max_policy_lag}")
        self.storage = storage
        self.sampler = sampler
        self.alpha, self.beta0, self.beta_steps, self.eps = float(alpha), float(beta), int(beta_steps), float(eps)
        self.max_policy_lag = max_policy_lag
        self.max_attempts = int(max_attempts)
        self.version_key = version_key
        self._tree = SumTree(storage.capacity) if sampler == "prioritized" else None
        self._max_priority = 1.0
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._lock = threading.Lock()
        self._sample_calls = 0
        self._counts = {"sampled": 0, "rejected_stale": 0, "rejected_invalid": 0}
        #: rows ever written (len() stops at the capacity): how a trainer that owes updates per collected row
        #: (SAC's updates_per_frame) knows how much data it has got; saved with the buffer
        self.written = 0

    def __len__(self) -> int:
        return len(self.storage)

    @property
    def beta(self) -> float:
        """The exponent the next :meth:`sample` call uses."""
        return min(1.0, self.beta0 + (1.0 - self.beta0) * self._sample_calls / self.beta_steps)

    def stats(self) -> dict[str, float]:
        """Size, items returned, rejections by cause, and the current beta."""
        with self._lock:
            return {"size": len(self.storage), **self._counts, "beta": self.beta, "sample_calls": self._sample_calls}

    # -- writing ---------------------------------------------------------------------------------
    def extend(self, batch: TensorDictBase) -> torch.Tensor:
        """Append ``batch`` (batch size ``[N]``); new items get the max priority. Returns their slots."""
        prepared = self.storage.prepare(batch)  # lock-free: validation, device moves, hashing
        with self._lock:
            indices = self.storage.write(prepared)
            self.written += int(indices.shape[0])
            if self._tree is not None:
                self._tree.update(indices.cpu().numpy(), self._max_priority**self.alpha)
        return indices

    def update_priorities(self, indices: Any, td_errors: Any) -> None:
        """Set ``p = |td error| + eps`` for sampled ``indices`` (a no-op for uniform sampling)."""
        if self._tree is None:
            return
        idx = _numpy(indices, np.int64)
        priority = np.abs(_numpy(td_errors, np.float64)) + self.eps
        if idx.shape != priority.shape:
            raise ValueError(f"{idx.size} indices but {priority.size} td errors")
        with self._lock:
            if idx.size and (idx.min() < 0 or idx.max() >= len(self.storage)):
                # A priority on an unfilled slot would make sample() return rows that were never written.
                raise IndexError(f"indices must lie in [0, {len(self.storage)}), got {idx.min()}..{idx.max()}")
            if priority.size and not priority.max() < np.inf:  # NaN or inf; >= eps > 0 by construction
                raise ValueError("td errors must be finite")
            self._tree.update(idx, priority**self.alpha, validate=False)
            if priority.size:
                self._max_priority = max(self._max_priority, float(priority.max()))

    # -- sampling --------------------------------------------------------------------------------
    def sample(self, batch_size: int, policy_version: int | None = None) -> TensorDict:
        """Draw ``batch_size`` items; adds ``"index"`` (int64 slots) and ``"weight"`` (float32).

        Raises:
            RuntimeError: if the buffer is empty or no item passes the
                policy-age filter (or can be rebuilt).
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        threshold = None
        if self.max_policy_lag is not None and policy_version is not None:
            threshold = int(policy_version) - self.max_policy_lag
        weights = None
        with self._lock:
            if len(self.storage) == 0:
                raise RuntimeError("cannot sample from an empty replay buffer")
            beta = self.beta
            self._sample_calls += 1
            indices = self._draw_eligible(batch_size, threshold, policy_version)
            data = self.storage.get(torch.from_numpy(indices))
            if self._tree is not None:
                # w_i / max_j w_j = (N P(i))^-beta / (N P_min)^-beta = (p_i / p_min)^-beta
                weights = (self._tree[indices] / self._tree.min) ** (-beta)
            self._counts["sampled"] += batch_size
        weight = torch.ones(batch_size) if weights is None else torch.from_numpy(weights.astype(np.float32))
        for key, value in (("index", torch.from_numpy(indices)), ("weight", weight)):
            data.set(key, value if data.device is None else value.to(data.device))
        return data

    def _draw(self, n: int) -> np.ndarray:
        if self._tree is None:
            return self._rng.integers(0, len(self.storage), n, dtype=np.int64)
        return self._tree.find(self._rng.random(n) * self._tree.total)

    def _draw_eligible(self, n: int, threshold: int | None, policy_version: int | None) -> np.ndarray:
        out = np.empty(n, dtype=np.int64)
        filled = 0
        check = self.storage.may_invalidate or threshold is not None
        for _ in range(self.max_attempts):
            if self._tree is not None and self._tree.total <= 0:
                break
            candidates = self._draw(n - filled)
            if check:
                candidates = candidates[self._keep(candidates, threshold, count=True)]
            out[filled : filled + candidates.size] = candidates
            filled += candidates.size
            if filled == n:
                return out
        # Exact pass: everything eligible, then draw from that alone.
        eligible = np.arange(len(self.storage), dtype=np.int64)
        eligible = eligible[self._keep(eligible, threshold, count=False)]
        if eligible.size == 0:
            raise RuntimeError(self._nothing_eligible(threshold, policy_version))
        need = n - filled
        if self._tree is None:
            out[filled:] = eligible[self._rng.integers(0, eligible.size, need)]
        else:
            cdf = np.cumsum(self._tree[eligible])
            if cdf[-1] <= 0:
                raise RuntimeError("every eligible item has priority 0")
            pick = np.searchsorted(cdf, self._rng.random(need) * cdf[-1], side="right")
            out[filled:] = eligible[np.minimum(pick, eligible.size - 1)]
        return out

    def _keep(self, candidates: np.ndarray, threshold: int | None, *, count: bool) -> np.ndarray:
        """Which candidates may be returned; invalid ones leave the sum tree for good."""
        keep = np.ones(candidates.size, dtype=bool)
        if self.storage.may_invalidate:
            keep = self.storage.valid_mask(torch.from_numpy(candidates)).cpu().numpy()
            invalid = ~keep
            if invalid.any():
                if count:
                    self._counts["rejected_invalid"] += int(invalid.sum())
                if self._tree is not None:
                    self._tree.update(candidates[invalid], 0.0)
        if threshold is not None:
            column = self.storage.field(self.version_key)
            versions = column[torch.from_numpy(candidates).to(column.device)].reshape(candidates.size, -1)[:, 0]
            stale = (versions < threshold).cpu().numpy() & keep
            if count:
                self._counts["rejected_stale"] += int(stale.sum())
            keep &= ~stale
        return keep

    def _nothing_eligible(self, threshold: int | None, policy_version: int | None) -> str:
        if threshold is None:
            return "no stored transition can be rebuilt: every one lost frames to the frame pool's wrap-around"
        newest = int(self.storage.field(self.version_key)[: len(self.storage)].max())
        return (f"no transition is fresh enough: sampling for policy_version {policy_version} with "
                f"max_policy_lag {self.max_policy_lag} needs stored {self.version_key} >= {threshold}, "
                f"the newest stored is {newest}; collect more data or raise max_policy_lag")

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Storage state, priorities, beta progress, RNG state and counters."""
        with self._lock:
            return {
                "storage": self.storage.state_dict(),
                "sampler": self.sampler,
                "priorities": torch.from_numpy(self._tree.values.copy()) if self._tree is not None else None,
                "max_priority": self._max_priority,
                "sample_calls": self._sample_calls,
                "rng": self._rng.bit_generator.state,
                "counts": dict(self._counts),
                "written": self.written,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` (disk storage reopens its files, see the storage)."""
        if state["sampler"] != self.sampler:
            raise ValueError(f"state_dict is for a {state['sampler']} buffer, this one is {self.sampler}")
        with self._lock:
            self.storage.load_state_dict(state["storage"])
            if self._tree is not None:
                self._tree.set_all(state["priorities"].numpy())
            self._max_priority = float(state["max_priority"])
            self._sample_calls = int(state["sample_calls"])
            self._rng.bit_generator.state = state["rng"]
            self._counts = dict(state["counts"])
            self.written = int(state.get("written", len(self.storage)))  # older checkpoints: at least what is kept
