"""n-step returns over collected batches of 1-step transitions from many envs.

Why a stateful transform and not a replay-side lookup: the collector hands
over batches in which an env's steps are contiguous but may be split across
batches; folding the n-step window in before writing keeps replay agnostic
(it stores transitions, whatever their horizon) and the trainer only needs
``gamma ** n_steps`` for its bootstrap. Transitions whose window has not
arrived yet are carried to the next call, so nothing is emitted twice or
built from a partial window.

Why vectorised over the whole batch: rows are sorted by (env, step) once and
the window is walked ``n`` times with array shifts, so the cost does not
depend on how many envs there are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from components.replay.storage import rows_of


def _as_key(key: str | Sequence[str]) -> str | tuple[str, ...]:
    return key if isinstance(key, str) else tuple(key)


class NStepReturns:
    """Turns 1-step transitions into n-step ones: ``R = sum_{k<m} gamma^k r_{t+k}``.

    For transition ``t`` of an env, the output keeps its observation and
    action, sums the rewards of ``t .. t+m-1``, takes every other ``next``
    field (observation, terminated, truncated, done, ...) from ``t+m-1`` and
    adds ``("next", "n_steps") = m``, where ``m = n`` or fewer when the
    episode ends (``done``) inside the window. A trainer bootstraps with
    ``gamma ** n_steps * (1 - terminated) * V(next observation)``.

    Output rows come in arrival order. ``n=1`` passes the batch through
    unchanged (plus ``n_steps``).

    Args:
        n: the horizon.
        gamma: the discount.
        env_key: the key naming each transition's env.
        step_key: the per-env step counter (contiguous within an env).

    Examples:
        >>> nstep = NStepReturns(n=3, gamma=0.5)
        >>> batch = TensorDict({
        ...     "env_index": torch.zeros(5, dtype=torch.int64), "env_step": torch.arange(5),
        ...     "next": {"reward": torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]),
        ...              "done": torch.tensor([False, False, True, False, False])}}, [5])
        >>> out = nstep(batch)
        >>> out["next", "reward"].tolist(), out["next", "n_steps"].tolist(), nstep.pending
        ([2.75, 3.5, 3.0], [3, 2, 1], 2)
    """

    def __init__(self, n: int, gamma: float, *, env_key: str | Sequence[str] = "env_index",
                 step_key: str | Sequence[str] = "env_step") -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n, self.gamma = int(n), float(gamma)
        self.env_key, self.step_key = _as_key(env_key), _as_key(step_key)
        self._carry: TensorDictBase | None = None

    @property
    def pending(self) -> int:
        """Transitions held back until their window completes."""
        return 0 if self._carry is None else int(self._carry.batch_size[0])

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        """The n-step transitions that are complete after ``batch`` arrived (batch size ``[M]``)."""
        rows_of(batch)
        if self.n == 1:
            out = batch.clone(False)
            reward = batch.get(("next", "reward"))
            out.set(("next", "n_steps"), torch.ones(reward.shape, dtype=torch.int64, device=reward.device))
            return out
        return self._windows(batch if self._carry is None else torch.cat([self._carry, batch], 0))

    def cut(self) -> TensorDictBase | None:
        """Close every window still open, as at a truncation, when its envs are replaced (a restart, a resume).

        The carried transitions' trajectories go on in envs that no longer
        exist: their windows end at the last step that arrived, bootstrapping
        from its observation (``n_steps`` < n), and nothing is carried on.
        Returns those transitions (None when nothing was carried).
        """
        if self._carry is None or self.n == 1:
            return None
        return self._windows(self._carry, cut=True)

    def _windows(self, full: TensorDictBase, cut: bool = False) -> TensorDictBase:
        rows = int(full.batch_size[0])
        env = full.get(self.env_key).reshape(-1).cpu().numpy()
        step = full.get(self.step_key).reshape(-1).cpu().numpy()
        order = np.lexsort((step, env))  # by env, then by step
        env, step = env[order], step[order]
        self._check_order(env, step)
        reward_t = full.get(("next", "reward"))
        reward = reward_t.reshape(rows, -1)[:, 0].cpu().numpy().astype(np.float64)[order]
        done = self._done(full)[order]
        # A forward gap in an env's steps is where a crashed worker's envs were replaced: the
        # trajectory was cut there, so the window closes as at a truncation (bootstrapping
        # from the last observation before the gap, never across it).
        done[:-1] |= (env[1:] == env[:-1]) & (step[1:] != step[:-1] + 1)
        if cut:  # each env's last step ends its trajectory here
            done |= np.r_[env[1:] != env[:-1], True]

        # Walk the window: k steps ahead of row i is row i + k when it belongs to the same env.
        here = np.arange(rows)
        total = np.zeros(rows)
        steps = np.zeros(rows, dtype=np.int64)
        last = here.copy()
        open_ = np.ones(rows, dtype=bool)  # window still growing: no done yet, rows still there
        ended = np.zeros(rows, dtype=bool)
        for k in range(self.n):
            ahead = np.minimum(here + k, rows - 1)
            present = (here + k < rows) & (env[ahead] == env)
            take = open_ & present
            total += np.where(take, self.gamma**k * reward[ahead], 0.0)
            last = np.where(take, ahead, last)
            steps += take
            ended |= take & done[ahead]
            open_ &= present & ~done[ahead]
        complete = ended | (steps == self.n)

        start = order[complete]
        arrival = np.argsort(start, kind="stable")
        start = start[arrival]
        final = order[last[complete]][arrival]
        out = full.exclude("next")[torch.from_numpy(start)]
        nxt = full.get("next")[torch.from_numpy(final)]
        returns = torch.from_numpy(total[complete][arrival]).to(reward_t.dtype)
        nxt.set("reward", returns.reshape(-1, *reward_t.shape[1:]).to(reward_t.device))
        n_steps = torch.from_numpy(steps[complete][arrival]).reshape(-1, *reward_t.shape[1:])
        nxt.set("n_steps", n_steps.to(reward_t.device))
        out.set("next", nxt)
        held = np.sort(order[~complete])
        self._carry = full[torch.from_numpy(held)] if held.size else None
        return out

    def _check_order(self, env: np.ndarray, step: np.ndarray) -> None:
        same = env[1:] == env[:-1]
        repeats = np.nonzero(same & (step[1:] == step[:-1]))[0]
        if repeats.size:
            i = int(repeats[0])
            raise ValueError(f"env {int(env[i])}: {self.step_key} {int(step[i])} arrived twice; "
                             "an env's steps must arrive once each")

    @staticmethod
    def _done(td: TensorDictBase) -> np.ndarray:
        rows = int(td.batch_size[0])
        nxt = td.get("next")
        if "done" in nxt.keys():
            done = nxt.get("done")
        elif "terminated" in nxt.keys() and "truncated" in nxt.keys():
            done = nxt.get("terminated") | nxt.get("truncated")
        else:
            raise KeyError("n-step returns need ('next', 'done') or ('next', 'terminated') and ('next', 'truncated')")
        return done.reshape(rows, -1)[:, 0].cpu().numpy().astype(bool)

    def state_dict(self) -> dict[str, Any]:
        """The carried transitions (plain nested dicts of tensors)."""
        carry = None if self._carry is None else self._carry.to_dict()
        return {"n": self.n, "gamma": self.gamma, "carry": carry, "pending": self.pending}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["n"]) != self.n or float(state["gamma"]) != self.gamma:
            raise ValueError(f"state_dict is for n={state['n']}, gamma={state['gamma']}; "
                             f"this transform has n={self.n}, gamma={self.gamma}")
        carry = state.get("carry")
        self._carry = None if carry is None else TensorDict(carry, batch_size=[int(state["pending"])])
