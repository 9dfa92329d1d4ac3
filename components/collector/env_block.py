"""A block of environments stepped together by one worker.

A worker hosts ``envs_per_worker`` envs and sends their observations as one
request, so signalling costs are paid per block, not per env. The block
writes every output straight into caller-provided arrays (rows of a shared
chunk buffer), so no per-transition Python objects survive a step.

What an env returns is held to its spec on the way in: a value that is
exactly what the spec says (the common case: one type/shape/dtype compare
per leaf) is written as it is; anything else goes through
:mod:`components.collector.spec_checks`, which accepts the scalar-like and
castable values gymnasium accepts and fails the step with a line naming the
env, the leaf, what it returned and what the spec promises otherwise (numpy
would broadcast some of those silently and fail on others in its own words).

Past each env's first step the block steps what is under ``gym.make``'s own
outer wrappers (:func:`peel_make_wrappers`), keeping their time limit itself:
the same transitions, three Python calls fewer per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from math import isfinite
from typing import Any

import numpy as np

from components.collector.make_wrappers import PeeledLimits, peel_make_wrappers
from components.collector.non_finite import non_finite_envs, raise_non_finite
from components.collector.tree_rows import TreeRows
from components.collector.value_checks import ObservationValues
from components.collector.spec_checks import (
    FAST_FLAGS,
    FAST_REWARDS,
    OffSpec,
    check_actions,
    check_flag,
    check_observation,
    check_reward,
    violation,
)
from components.envs import EnvSpec

#: a step's terminated/truncated flags when no episode ended (never written to)
_NO_FLAGS: list[bool] = []
#: Keys of the env half of a transition (the policy adds its outputs).
NEXT_KEYS = (
    "next.observation",
    "next.reward",
    "next.terminated",
    "next.truncated",
    "next.done",
    "next.episode_return",
    "next.episode_length",
)


class EnvBlock:
    """Steps ``len(env_ids)`` envs with automatic reset and episode tracking.

    Examples:
        >>> from components.envs import GymEnvFactory
        >>> block = EnvBlock(GymEnvFactory("CartPole-v1"), env_ids=[0, 1], seeds=[1, 2])
        >>> obs = np.zeros((2, 4), np.float32)
        >>> block.reset(obs)
        >>> rows = block.empty_rows()
        >>> block.step(np.array([0, 1]), rows, obs)  # envs whose step was cut out as non-finite
        0
        >>> rows["next.episode_length"].tolist()
        [1, 1]
        >>> block.close()
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        env_ids: Sequence[int],
        seeds: Sequence[int],
        first_step: int = 0,
        skip_non_finite: bool = False,
    ) -> None:
        if len(env_ids) != len(seeds):
            raise ValueError("one seed per env is required")
        self.env_ids = np.asarray(env_ids, dtype=np.int64)
        # an env set (components.env_set) builds and seeds each env id by its own entry
        for_env, seed_of = getattr(factory, "for_env", None), getattr(factory, "seed_of", None)
        self.seeds = [int(s) if seed_of is None else seed_of(i, s) for i, s in zip(env_ids, seeds)]
        self._envs: list[Any] = []
        try:
            for i in env_ids:
                self._envs.append(factory() if for_env is None else for_env(i)())
        except BaseException:
            self.close()
            raise
        self.spec = EnvSpec.from_env(self._envs[0])
        # actions passed one row at a time (numpy integers or int arrays); Box actions are clipped to the box
        self._discrete = self.spec.action_kind in ("discrete", "multi_discrete", "multi_binary")
        # What the fast paths compare against (see spec_checks for what else is accepted).
        self._obs_shape, self._obs_dtype = tuple(self.spec.obs_shape), np.dtype(self.spec.obs_dtype)
        self._action_rows = (len(self._envs), *self.spec.action_shape)
        self._action_dtype = np.dtype(self.spec.action_dtype)
        self._int_scalar_obs = self._obs_shape == () and self._obs_dtype.kind in "iu"
        #: an observation dtype other than the spec's that was checked and accepted (a float64 obs of a
        #: float32 space): later observations of that dtype take the fast path too
        self._cast_dtype: np.dtype | None = None
        # Integer observations (Atari frames) cannot be NaN: only float ones are checked.
        self._float_obs = np.issubdtype(np.dtype(self.spec.obs_dtype), np.floating)
        #: a Dict/Tuple observation: its leaves written into packed rows, each checked (components.obs_tree)
        self._tree = TreeRows(self.spec) if self.spec.is_tree else None
        #: categories inside the space, masks allowing some action (components.collector.value_checks)
        self._values = ObservationValues(self.spec, self._tree, self.env_ids)
        if self._tree is not None:
            self._float_obs = self._tree.has_float
        if not self._discrete:
            self._low = np.asarray(self.spec.action_low, np.float32).reshape(self.spec.action_shape)
            self._high = np.asarray(self.spec.action_high, np.float32).reshape(self.spec.action_shape)
        n = len(self._envs)
        #: what the finite checks of a step's rewards and (flat) observations sum with
        self._ones_rows = np.ones(n, np.float32)
        self._ones_obs = (np.ones(n * int(np.prod(self._obs_shape, dtype=np.int64)), self._obs_dtype)
                          if self._float_obs and self._tree is None else None)
        #: what each env's step is called on: the whole chain for its first step (gymnasium's checker sees
        #: it), then what is under gym.make's own wrappers (:func:`peel_make_wrappers`)
        self._stepped = list(self._envs)
        peeled = [peel_make_wrappers(env) for env in self._envs]
        self._cores = [core for core, _ in peeled]
        #: the peeled TimeLimits' rule (None: no env had one)
        self._limits = PeeledLimits([limit for _, limit in peeled]) if any(limit for _, limit in peeled) else None
        self._episode_return = np.zeros(n, np.float64)
        #: Steps taken by every env of the block since it started (contiguous). A block that
        #: replaces a crashed one starts past its predecessor's steps, leaving a gap that tells
        #: learners the trajectory was cut there.
        self.steps = int(first_step)
        #: per env, the block step its episode began at: its length is ``steps`` minus it (one subtraction a
        #: step writes every length, where a counter took an add and a copy)
        self._episode_start = np.full(n, self.steps, np.int64)
        #: ``trainer.nan_policy=skip``: a non-finite step is cut out (see :meth:`step`), not an error
        self.skip_non_finite = skip_non_finite

    def __len__(self) -> int:
        return len(self._envs)

    @property
    def env_step(self) -> np.ndarray:
        """Each env's step count (one for all: a block's envs step together; a Python int in :attr:`steps`)."""
        return np.full(len(self.env_ids), self.steps, np.int64)

    def empty_rows(self) -> dict[str, np.ndarray]:
        """Private arrays for one step's env outputs (tests, thread helpers)."""
        n, spec = len(self), self.spec
        return {
            "next.observation": np.zeros((n, *spec.obs_shape), spec.obs_dtype),
            "next.reward": np.zeros(n, np.float32),
            "next.terminated": np.zeros(n, bool),
            "next.truncated": np.zeros(n, bool),
            "next.done": np.zeros(n, bool),
            "next.episode_return": np.zeros(n, np.float32),
            "next.episode_length": np.zeros(n, np.int64),
        }

    def reset(self, obs_out: np.ndarray) -> None:
        """Reset every env with its own seed and write the first observations."""
        views = None if self._tree is None else self._tree.views(obs_out)
        for i, env in enumerate(self._envs):
            obs, _ = env.reset(seed=self.seeds[i])
            env.action_space.seed(self.seeds[i])
            if views is None:
                obs_out[i] = self._observation(i, obs, "on its first reset")
            else:
                self._checked(i, "on its first reset", self._tree.write, views, i, obs)
        if self._values.active:
            self._values.check(obs_out[:len(self._envs)], "on its first reset", self.env_step)
        self._episode_return[:] = 0.0
        self._episode_start[:] = self.steps
        if self._limits is not None:
            self._limits.restart()

    def step(
        self,
        actions: np.ndarray,
        rows: Mapping[str, np.ndarray],
        obs_out: np.ndarray,
        truncate: bool = False,
        acted: np.ndarray | None = None,
        actions_checked: bool = False,
        flags_clear: bool = False,
    ) -> int:
        """Step every env once; returns how many envs' steps were cut out as non-finite.

        Writes the env half of the transition into ``rows`` (arrays indexed by
        env) and the observations the policy must act on next into
        ``obs_out``: the successor, or the first observation of a new episode
        where one ended (``rows["next.observation"]`` keeps the final one).
        ``truncate`` ends every episode after this step, as a time limit
        would (``reset_at_each_iter``): the transition is marked truncated,
        so learners bootstrap it instead of chaining it to the next one.

        A value off the spec (see :mod:`~components.collector.spec_checks`)
        is a ``ValueError`` naming the env, the leaf, what it returned and
        what the spec promises.
        A NaN or infinite reward or observation is an error naming the env;
        with ``skip_non_finite`` the step is cut out instead: recorded as a
        zero-reward truncation back to the observation acted on (so nothing
        non-finite reaches a learner, and a bootstrap from it is neutral),
        and the env is reset.

        ``acted`` (the observations acted on, somewhere else than
        ``obs_out``) turns on *sparse finals*, the chunk's one-copy path: each
        env's observation is written once, into ``obs_out``, and
        ``rows["next.observation"]`` only where an episode ended (the final
        observation, which a reset replaces in ``obs_out``). Everywhere else
        the successor is ``obs_out`` itself, so a reader that knows the
        layout (:class:`~components.collector.chunks.ChunkPool` with an
        observation stream) derives it without a second copy of every frame.
        ``actions_checked``: the caller ran :meth:`check_actions` on them already.
        ``flags_clear``: the rows' terminated/truncated/done flags are all
        False already (a chunk's, cleared once for all its steps): they are
        written only where an episode ended.
        """
        skipped = 0
        next_obs = rows["next.observation"]
        sparse = acted is not None
        # where each env's new observation is written first: once, wherever it is read from next
        fresh = obs_out if sparse else next_obs
        if not actions_checked:
            self.check_actions(actions)
        # numpy integers (or rows), as gymnasium's vector envs pass them: Discrete.contains (which most envs
        # assert) takes 2.1 us for a Python int (an np.iinfo each time) and 1.7 us for an np.int64.
        acts = actions if self._discrete else np.clip(actions, self._low, self._high)
        n = len(self._envs)
        rewards = [0.0] * n
        ended: list[int] = []
        # flags only where an episode ended (most steps: none); filled in after the loop
        flags: list[tuple[int, bool, bool]] = []
        tree = self._tree
        if tree is None:
            shape, dtype, ndarray, int_obs = self._obs_shape, self._obs_dtype, np.ndarray, self._int_scalar_obs
            cast = self._cast_dtype
            fast_rewards, fast_flags = FAST_REWARDS, FAST_FLAGS
            i = 0
            # iterating the action array gives numpy integers (rows, for multi-part actions), as gymnasium's
            # vector envs pass them: Discrete.contains (which most envs assert) takes 2.1 us for a Python int
            # (an np.iinfo each time) and 1.7 us for an np.int64
            for env, action in zip(self._stepped, acts):
                obs, reward, term, trunc, _ = env.step(action)
                # The fast path: exactly what the spec says is written as it is (a Python int too, for a
                # Discrete observation space: toy-text envs return one every step); anything else is checked.
                if (((type(obs) is not ndarray or obs.shape != shape
                      or (obs.dtype is not dtype and obs.dtype is not cast)) and not (type(obs) is int and int_obs))
                        or type(reward) not in fast_rewards or type(term) not in fast_flags
                        or type(trunc) not in fast_flags):
                    obs, reward, term, trunc = self._check_step(i, obs, reward, term, trunc)
                fresh[i] = obs
                rewards[i] = reward
                if term or trunc:
                    flags.append((i, term, trunc))
                i += 1
        else:  # a Dict/Tuple: each leaf into its view of the packed row, held to its space
            views = tree.views(fresh)
            for i, (env, action) in enumerate(zip(self._stepped, acts)):
                obs, reward, term, trunc, _ = env.step(action)
                self._checked(i, None, tree.write, views, i, obs)
                if type(reward) not in FAST_REWARDS or type(term) not in FAST_FLAGS or type(trunc) not in FAST_FLAGS:
                    _, reward, term, trunc = self._check_step(i, None, reward, term, trunc)
                rewards[i] = reward
                if term or trunc:
                    flags.append((i, term, trunc))
        # the peeled TimeLimit's rule: the step that reaches the limit is truncated (terminated or not)
        limited = () if self._limits is None else self._limits.reached(self.steps, self._episode_start)
        terminated, truncated = _NO_FLAGS, _NO_FLAGS  # per env, made only when some episode ends
        if flags or truncate or limited:
            terminated, truncated = [False] * n, [False] * n
            for i, term, trunc in flags:
                terminated[i], truncated[i] = term, trunc
                ended.append(i)
            if truncate:  # reset_at_each_iter: every episode not terminated ends here, truncated
                truncated = [trunc or not term for term, trunc in zip(terminated, truncated)]
                ended = list(range(n))
            for i in limited:
                truncated[i] = True
                if i not in ended:
                    ended.append(i)
        self._stepped = self._cores  # every env took its first step through its whole chain: from now on, under it
        reward_arr = rows["next.reward"]
        reward_arr[:] = rewards
        # One sum per leaf, as a dot product with ones (BLAS: ~0.25 us under numpy's reduction on a small
        # block): a sum is finite when every value is (one that overflows takes the exact check below, which
        # then finds nothing); a quarter of the isfinite-then-all cost on small blocks.
        if not isfinite(self._ones_rows.dot(reward_arr)) or (self._float_obs and not (
                isfinite(self._ones_obs.dot(fresh.reshape(-1))) if tree is None else tree.finite(fresh))):
            if not self.skip_non_finite:
                raise_non_finite(reward_arr, fresh, self._tree, self._float_obs, self.env_ids, self.env_step)
            for i in non_finite_envs(reward_arr, fresh, self._tree, self._float_obs):
                fresh[i] = acted[i] if sparse else obs_out[i]  # the observation acted on
                reward_arr[i] = 0.0
                if terminated is _NO_FLAGS:
                    terminated, truncated = [False] * n, [False] * n
                terminated[i], truncated[i] = False, True
                if i not in ended:
                    ended.append(i)
                skipped += 1
        if self._values.active:
            self._values.check(fresh, None, self.env_step, masks=False)
        done = rows["next.done"]
        if ended and flags_clear:  # a True written where an episode ended (one or two envs a step, typically)
            terminated_out, truncated_out = rows["next.terminated"], rows["next.truncated"]
            for i in ended:
                if terminated[i]:
                    terminated_out[i] = True
                if truncated[i]:
                    truncated_out[i] = True
                done[i] = True
        elif ended:
            rows["next.terminated"][:] = terminated
            rows["next.truncated"][:] = truncated
            np.logical_or(rows["next.terminated"], rows["next.truncated"], out=done)
        elif not flags_clear:  # most steps: three fills instead of two list conversions and an or
            rows["next.terminated"].fill(False)
            rows["next.truncated"].fill(False)
            done.fill(False)
        self._episode_return += reward_arr
        self.steps += 1
        rows["next.episode_return"][:] = self._episode_return
        np.subtract(self.steps, self._episode_start, out=rows["next.episode_length"])
        if sparse:
            for i in ended:
                next_obs[i] = obs_out[i]  # the final observation, before the reset replaces it
        else:
            obs_out[:] = next_obs
        out_views = None if tree is None or not ended else tree.views(obs_out)
        for i in ended:
            obs, _ = self._cores[i].reset()  # under gym.make's wrappers, as the steps (their reset adds nothing)
            if out_views is not None:
                self._checked(i, f"on the reset after its step {self.steps}", tree.write, out_views, i, obs)
            else:
                if ((type(obs) is not ndarray or obs.shape != shape
                     or (obs.dtype is not dtype and obs.dtype is not cast)) and not (type(obs) is int and int_obs)):
                    obs = self._observation(i, obs, f"on the reset after its step {self.steps}")
                obs_out[i] = obs
            if self._values.active:
                self._values.check(obs_out[i:i + 1], f"on the reset after its step {self.steps}",
                                   self.env_step, i, masks=False)
            self._episode_return[i] = 0.0
            self._episode_start[i] = self.steps
        if self._values.has_mask:  # every observation acted on next must allow some action
            self._values.check_tree(obs_out[:len(self._envs)], None, self.env_step, 0, True, categories=False)
        return skipped

    def check_actions(self, actions: Any) -> None:
        """A ``ValueError`` naming the envs when the policy's action batch is off the action space.

        Cheap (a shape and dtype compare), so a caller that copies the actions
        somewhere first (a chunk row) can call it before that copy too.
        """
        if (type(actions) is not np.ndarray or actions.shape != self._action_rows
                or actions.dtype is not self._action_dtype):
            check_actions(actions, self.spec, self.env_ids)  # raises unless only the dtype differs, castably

    def _check_step(self, i: int, obs: Any, reward: Any, term: Any, trunc: Any) -> tuple[Any, Any, bool, bool]:
        """What env ``i``'s step returned, the leaves the fast path would not take checked."""
        if self._tree is None and not ((type(obs) is np.ndarray and obs.shape == self._obs_shape
                                        and (obs.dtype is self._obs_dtype or obs.dtype is self._cast_dtype))
                                       or (type(obs) is int and self._int_scalar_obs)):
            obs = self._observation(i, obs, None)
        if type(reward) not in FAST_REWARDS:
            reward = self._checked(i, None, check_reward, reward)
        if type(term) not in FAST_FLAGS:
            term = self._checked(i, None, check_flag, term, "terminated")
        if type(trunc) not in FAST_FLAGS:
            trunc = self._checked(i, None, check_flag, trunc, "truncated")
        return obs, reward, term, trunc

    def _observation(self, i: int, obs: Any, when: str | None) -> np.ndarray:
        """Env ``i``'s observation checked; an array of another dtype that passed is remembered as castable."""
        array = self._checked(i, when, check_observation, obs, self.spec)
        if type(obs) is np.ndarray:
            self._cast_dtype = obs.dtype
        return array

    def _checked(self, i: int, when: str | None, check: Callable[..., Any], *args: Any) -> Any:
        """``check(*args)``; its :class:`OffSpec` becomes the full error, naming env ``i`` and ``when``.

        ``when`` None: during the step under way (its number is the one the
        non-finite check names).
        """
        try:
            return check(*args)
        except OffSpec as err:
            at = when if when is not None else f"at its step {self.steps + 1}"
            raise violation(int(self.env_ids[i]), at, err) from None

    def close(self) -> None:
        for env in self._envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing must not mask the real error
                pass
        self._envs = []
