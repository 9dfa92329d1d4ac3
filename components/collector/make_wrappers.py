"""What is under ``gym.make``'s own outer wrappers: what an env block steps once an env took its first step."""

from __future__ import annotations

from typing import Any

import numpy as np

#: "no time limit" in the per-env step limits (a step count no episode reaches, with room to add to it)
_NO_LIMIT = np.iinfo(np.int64).max // 2


def peel_make_wrappers(env: Any) -> tuple[Any, int]:
    """The env under ``gym.make``'s own outer wrappers, and the step limit its ``TimeLimit`` held (0: none).

    ``TimeLimit``, ``OrderEnforcing`` and ``PassiveEnvChecker`` (exactly
    those types, outermost, in any order) only forward a step once the
    env was reset and stepped once: the checker checks the first step, the
    order check is the block's own invariant (it resets every env before
    stepping it), and the time limit is a count the block keeps anyway
    (its episode lengths). Stepping under them saves three Python calls a
    step, 0.3-0.5 us of CartPole's ~5 us (measured), more than every check
    the block adds. The resets that start later episodes go under them too
    (a reset there only zeroes the peeled limit's count and sets the order
    flag already set): 1.5 % of a 32-env CartPole worker's CPU. Anything
    else (a user's wrapper, a preprocessing chain) stops the peeling: what
    is under it is stepped as it is.
    """
    from gymnasium.wrappers import OrderEnforcing, PassiveEnvChecker, TimeLimit

    limit = 0
    while True:
        kind = type(env)
        if kind is TimeLimit:
            steps = int(env._max_episode_steps)
            limit = steps if limit == 0 else min(limit, steps)
        elif kind is not OrderEnforcing and kind is not PassiveEnvChecker:
            return env, limit
        env = env.env


class PeeledLimits:
    """The peeled ``TimeLimit``s' rule, kept by the block: the step that reaches an env's limit is truncated.

    Lengths are compared with the limits only on the steps where one can
    be reached: each block step adds one to every env's length and an
    episode's end only shortens one, so after a compare nothing can reach
    its limit for as many steps as the least headroom left (one compare
    per ~500 steps on CartPole; comparing every step was 3.6 % of a
    16-env CartPole worker's time).
    """

    def __init__(self, limits: list[int]) -> None:
        #: per env, its limit minus one (a length before the step's); no limit (0) never reached
        self.before = np.array([limit - 1 if limit else _NO_LIMIT for limit in limits], np.int64)
        self._wait = 0  # steps before the next compare

    def restart(self) -> None:
        """Every episode starts over (the block's reset): compare on the next step."""
        self._wait = 0

    def reached(self, steps: int, starts: np.ndarray) -> list[int]:
        """The envs whose step under way reaches their limit (``steps`` before it, ``starts``: their episodes')."""
        if self._wait:
            self._wait -= 1
            return []
        headroom = self.before - (steps - starts)  # each env's length before the step
        # an env cut now starts over: the first step that can reach its limit again is one past the whole limit
        self._wait = max(0, int(np.where(headroom > 0, headroom, self.before + 1).min()) - 1)
        return np.flatnonzero(headroom <= 0).tolist()
