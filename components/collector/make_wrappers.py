"""What is under ``gym.make``'s own outer wrappers: what an env block steps once an env took its first step."""

from __future__ import annotations

from typing import Any


def peel_make_wrappers(env: Any) -> tuple[Any, int]:
    """The env under ``gym.make``'s own outer wrappers, and the step limit its ``TimeLimit`` held (0: none).

    ``TimeLimit``, ``OrderEnforcing`` and ``PassiveEnvChecker`` (exactly
    those types, outermost, in any order) only forward a step once the
    env was reset and stepped once: the checker checks the first step, the
    order check is the block's own invariant (it resets every env before
    stepping it), and the time limit is a count the block keeps anyway
    (its episode lengths). Stepping under them saves three Python calls a
    step, 0.3-0.5 us of CartPole's ~5 us (measured), more than every check
    the block adds. Anything else (a user's wrapper, a preprocessing chain)
    stops the peeling: what is under it is stepped as it is.
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
