"""Env factories, seeding and the env block a worker steps."""

from __future__ import annotations

import numpy as np
import pytest

from components.collector.env_block import EnvBlock
from components.envs import AtariEnvFactory, EnvConfigError, EnvSpec, GymEnvFactory, check_env_id, env_seeds


def test_env_seeds_are_distinct_within_and_across_run_seeds():
    a, b = env_seeds(0, 64), env_seeds(1, 64)
    assert len(set(a)) == 64 and len(set(b)) == 64
    assert not set(a) & set(b), "seed 0 and seed 1 must never share an env seed"
    assert env_seeds(0, 64) == a


def test_unknown_env_id_names_close_matches():
    with pytest.raises(EnvConfigError, match="CartPole-v1"):
        check_env_id("CartPol-v1")


def test_ale_ids_outside_the_ale_namespace_are_known_in_a_fresh_interpreter():
    # ale-py registers PongNoFrameskip-v4 / Breakout-v4 only when imported; a fresh process has not imported it
    pytest.importorskip("ale_py")
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("import gymnasium as gym; from components.envs import check_env_id, GymEnvFactory; "
            "assert 'PongNoFrameskip-v4' not in gym.registry; check_env_id('PongNoFrameskip-v4'); "
            "check_env_id('Breakout-v4'); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    with pytest.raises(EnvConfigError, match="is not a registered gymnasium environment"):
        check_env_id("PongNoFrameskip-v9")  # still unknown after ale-py registered its ids


def test_spec_reads_discrete_and_box_spaces():
    spec = EnvSpec.from_env(GymEnvFactory("CartPole-v1")())
    assert spec.obs_shape == (4,) and spec.obs_dtype == "float32"
    assert spec.action_kind == "discrete" and spec.action_n == 2
    cont = EnvSpec.from_env(GymEnvFactory("Pendulum-v1")())
    assert cont.action_kind == "continuous" and cont.action_shape == (1,)
    assert cont.action_low == (-2.0,) and cont.action_high == (2.0,)


def _run_block(block: EnvBlock, steps: int, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    obs = np.zeros((len(block), *block.spec.obs_shape), block.spec.obs_dtype)
    block.reset(obs)
    rows = []
    for _ in range(steps):
        row = block.empty_rows()
        acted_on = obs.copy()
        block.step(rng.integers(0, 2, len(block)), row, obs)
        row["observation"] = acted_on
        row["next_request"] = obs.copy()
        rows.append(row)
    return rows


def test_block_resets_ended_episodes_and_tracks_returns():
    block = EnvBlock(GymEnvFactory("CartPole-v1"), env_ids=[3, 4], seeds=[10, 11])
    try:
        rows = _run_block(block, 200, np.random.default_rng(0))
    finally:
        block.close()
    ended = 0
    for t, row in enumerate(rows):
        for i in range(2):
            if row["next.done"][i]:
                ended += 1
                # CartPole pays 1 per step: the return equals the length.
                assert row["next.episode_return"][i] == row["next.episode_length"][i]
                # the policy next sees a fresh episode, not the terminal state
                assert not np.array_equal(row["next_request"][i], row["next.observation"][i])
                if t + 1 < len(rows):
                    assert rows[t + 1]["next.episode_length"][i] == 1
            else:
                assert np.array_equal(row["next_request"][i], row["next.observation"][i])
    assert ended > 0
    assert block.env_step.tolist() == [200, 200]


def test_same_seeds_reproduce_the_same_trajectories():
    def trajectory() -> np.ndarray:
        block = EnvBlock(GymEnvFactory("CartPole-v1"), env_ids=[0], seeds=[123])
        try:
            return np.stack([r["next.observation"] for r in _run_block(block, 50, np.random.default_rng(1))])
        finally:
            block.close()

    assert np.array_equal(trajectory(), trajectory())


def test_atari_factory_gives_uint8_frame_stacks():
    pytest.importorskip("ale_py")
    env = AtariEnvFactory()()
    try:
        obs, _ = env.reset(seed=0)
        assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
        spec = EnvSpec.from_env(env)
        assert spec.action_kind == "discrete" and spec.action_n == 6
    finally:
        env.close()


def test_atari_frames_are_the_same_whether_the_inner_env_renders_rgb_or_grey():
    # the grey inner env only saves a copy: the preprocessing reads the screen from the emulator itself
    pytest.importorskip("ale_py")

    def frames(obs_type: str) -> list[np.ndarray]:
        env = AtariEnvFactory(kwargs={"obs_type": obs_type})()
        try:
            obs, _ = env.reset(seed=4)
            rng = np.random.default_rng(0)
            out = [obs]
            for _ in range(120):
                obs, _, term, trunc, _ = env.step(int(rng.integers(6)))
                out.append(obs)
                if term or trunc:
                    out.append(env.reset()[0])
            return out
        finally:
            env.close()

    grey, rgb = frames("grayscale"), frames("rgb")
    assert len(grey) == len(rgb) and all(np.array_equal(a, b) for a, b in zip(grey, rgb))
    assert any(not np.array_equal(grey[0], g) for g in grey[1:]), "the screen changes: the test compares something"


@pytest.mark.parametrize(("game", "life_loss"), [("ALE/Pong-v5", False), ("ALE/Breakout-v5", True)])
def test_direct_atari_preprocessing_gives_gymnasiums_frames_rewards_and_ends(game, life_loss):
    """Same seed, same actions: every observation, reward, end and life count equals gymnasium's wrapper's."""
    pytest.importorskip("ale_py")
    from components.atari import DirectAtariPreprocessing

    def trajectory(direct: bool) -> list[tuple]:
        env = AtariEnvFactory(game, terminal_on_life_loss=life_loss, direct=direct)()
        try:
            inner = env.env
            assert isinstance(inner, DirectAtariPreprocessing) == direct
            if direct:
                assert inner.direct_blocker is None, inner.direct_blocker
            obs, _ = env.reset(seed=11)
            rng = np.random.default_rng(5)
            out: list[tuple] = [(obs,)]
            for _ in range(700):
                obs, reward, term, trunc, info = env.step(int(rng.integers(env.action_space.n)))
                out.append((obs, reward, term, trunc, info["lives"]))
                if term or trunc:
                    out.append((env.reset()[0],))
            return out
        finally:
            env.close()

    direct, reference = trajectory(True), trajectory(False)
    assert len(direct) == len(reference)
    for step, (a, b) in enumerate(zip(direct, reference)):
        assert np.array_equal(a[0], b[0]) and a[1:] == b[1:], f"step {step} differs"
    ends = sum(1 for t in reference if len(t) > 1 and (t[2] or t[3]))
    assert ends >= (3 if life_loss else 0), "Breakout loses lives within the test: the end paths are compared"
    assert any(t[1] for t in reference if len(t) > 1), "some reward was seen: the sums are compared"


def test_direct_atari_preprocessing_steps_through_a_time_limit_the_way_gymnasium_does():
    pytest.importorskip("ale_py")

    def truncated_at(direct: bool) -> int:
        env = AtariEnvFactory("ALE/Pong-v5", kwargs={"max_episode_steps": 40}, direct=direct)()
        try:
            if direct:
                assert "TimeLimit" in (env.env.direct_blocker or "")
            env.reset(seed=0)  # the no-op starts count against the limit too
            for step in range(1, 41):
                if env.step(0)[3]:
                    return step
            return -1
        finally:
            env.close()

    assert truncated_at(True) == truncated_at(False) > 0


def _reference_rollout(env_id: str, kwargs: dict | list[dict], seeds: list[int], actions: np.ndarray,
                       cut_at: frozenset[int] = frozenset()) -> dict[str, np.ndarray]:
    """gym.make's whole wrapper chain stepped by hand, reset at every episode end: what the block must match.

    ``kwargs``: one dict for every env, or one per env; ``cut_at``: steps after which every episode is cut.
    """
    import gymnasium as gym

    per_env = kwargs if isinstance(kwargs, list) else [kwargs] * len(seeds)
    envs = [gym.make(env_id, **k) for k in per_env]
    for env, s in zip(envs, seeds):
        env.reset(seed=s)
    out = {"obs": [], "reward": [], "terminated": [], "truncated": [], "length": []}
    lengths = [0] * len(envs)
    for t, step_actions in enumerate(actions):
        row = {k: [] for k in out}
        for i, env in enumerate(envs):
            o, r, term, trunc, _ = env.step(step_actions[i])
            trunc = trunc or (t in cut_at and not term)
            lengths[i] += 1
            row["obs"].append(o)
            row["reward"].append(r)
            row["terminated"].append(term)
            row["truncated"].append(trunc)
            row["length"].append(lengths[i])
            if term or trunc:
                env.reset()
                lengths[i] = 0
        for k in out:
            out[k].append(np.array(row[k]))
    for env in envs:
        env.close()
    return {k: np.stack(v) for k, v in out.items()}


class _LimitsInTurn:
    """CartPole factories whose envs take the time limits of ``limits`` in turn (None: gym.make's own, 500)."""

    def __init__(self, limits: list[int | None]) -> None:
        self.limits, self.built = limits, 0

    def __call__(self):  # noqa: ANN204
        import gymnasium as gym

        limit = self.limits[self.built % len(self.limits)]
        self.built += 1
        return gym.make("CartPole-v1", **({} if limit is None else {"max_episode_steps": limit}))


@pytest.mark.parametrize("limit", [7, None, "mixed", "mixed-cut"])
def test_stepping_under_gym_makes_wrappers_matches_the_whole_chain_time_limits_included(limit):
    # the block compares lengths with the limits only when one may be reached (see EnvBlock._limit_wait):
    # limits of their own per env, and episodes cut early (reset_at_each_iter), must not throw that count off
    seeds, steps = [3, 4, 5], 60
    limits = {7: [7], None: [None], "mixed": [5, None, 9], "mixed-cut": [5, None, 9]}[limit]
    kwargs = [{} if lim is None else {"max_episode_steps": lim} for lim in limits * 3][:3]
    cut_at = frozenset({2, 13, 14, 40}) if limit == "mixed-cut" else frozenset()
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 2, (steps, len(seeds)))
    want = _reference_rollout("CartPole-v1", kwargs, seeds, actions, cut_at)
    factory = GymEnvFactory("CartPole-v1", kwargs[0]) if len(limits) == 1 else _LimitsInTurn(limits)
    block = EnvBlock(factory, env_ids=[0, 1, 2], seeds=seeds)
    try:
        obs = np.zeros((3, 4), np.float32)
        block.reset(obs)
        for t in range(steps):
            rows = block.empty_rows()
            block.step(actions[t], rows, obs, truncate=t in cut_at)
            np.testing.assert_array_equal(rows["next.observation"], want["obs"][t], err_msg=f"step {t}")
            assert rows["next.reward"].tolist() == want["reward"][t].tolist()
            assert rows["next.terminated"].tolist() == want["terminated"][t].tolist(), t
            assert rows["next.truncated"].tolist() == want["truncated"][t].tolist(), t
            assert rows["next.episode_length"].tolist() == want["length"][t].tolist(), t
        assert block._stepped is block._cores, "after the first step the block steps under the wrappers"
        assert all(type(core).__name__ == "CartPoleEnv" for core in block._cores)
    finally:
        block.close()
    if limit is not None:
        assert want["truncated"].sum() >= 3, "the limit cut episodes (what this test is about)"
    if limit == "mixed":
        assert want["truncated"][:, 0].sum() >= 2 and want["truncated"][:, 2].sum() >= 1, "each its own limit"


def test_episodes_after_the_first_reset_under_gym_makes_wrappers(monkeypatch):
    # a reset through TimeLimit/OrderEnforcing/PassiveEnvChecker adds three Python calls and nothing the block
    # needs (its own lengths are the time limit): ~1.5 % of a 32-env CartPole worker's CPU
    from gymnasium.wrappers import TimeLimit

    calls = []
    whole_chain_reset = TimeLimit.reset

    def counted(self, **kwargs):  # noqa: ANN001, ANN003, ANN202
        calls.append(kwargs.get("seed"))
        return whole_chain_reset(self, **kwargs)

    monkeypatch.setattr(TimeLimit, "reset", counted)
    block = EnvBlock(GymEnvFactory("CartPole-v1", {"max_episode_steps": 5}), env_ids=[0, 1], seeds=[7, 8])
    try:
        obs = np.zeros((2, 4), np.float32)
        block.reset(obs)
        assert calls == [7, 8], "the first resets go through the whole chain (the checker sees them)"
        ends = 0
        for _ in range(12):
            rows = block.empty_rows()
            block.step(np.array([0, 1]), rows, obs)
            ends += int(rows["next.done"].sum())
        assert ends >= 4 and calls == [7, 8], "later episodes start under the wrappers"
    finally:
        block.close()


def test_a_wrapper_of_the_users_own_stops_the_peeling():
    import gymnasium as gym

    class Shaped(gym.Wrapper):
        def step(self, action):
            obs, reward, term, trunc, info = self.env.step(action)
            return obs, reward * 2.0, term, trunc, info

    block = EnvBlock(lambda: Shaped(gym.make("CartPole-v1")), env_ids=[0], seeds=[1])
    try:
        obs = np.zeros((1, 4), np.float32)
        block.reset(obs)
        for _ in range(3):
            rows = block.empty_rows()
            block.step(np.array([1]), rows, obs)
            assert rows["next.reward"].tolist() == [2.0], "the user's wrapper still runs"
        assert isinstance(block._cores[0], Shaped)
    finally:
        block.close()


class _CountingEnv:
    """Returns ``base + step`` in an observation of ``space``'s shape, as ``returned_dtype`` (or a Python int)."""

    def __init__(self, space, base: int, returned_dtype=None) -> None:  # noqa: ANN001
        import gymnasium as gym

        self.observation_space, self.action_space = space, gym.spaces.Discrete(2)
        self.base, self.t, self.returned_dtype = base, 0, returned_dtype

    def _obs(self):  # noqa: ANN202
        value = self.base + self.t
        if self.returned_dtype is int:
            return value
        return np.full(self.observation_space.shape, value, self.returned_dtype or self.observation_space.dtype)

    def reset(self, seed=None, options=None):  # noqa: ANN001, ANN201
        self.t = 0
        return self._obs(), {}

    def step(self, action):  # noqa: ANN001, ANN201
        self.t += 1
        return self._obs(), 1.0, False, False, {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("case", ["frames", "cast", "scalar", "strided"])
def test_every_envs_observation_lands_in_its_own_row(case):
    # the block writes a step's observations into their rows at once (one concatenate, the envs' first axes
    # joined); each env's values must land in its row whatever the shape, the returned dtype or the rows' layout
    import gymnasium as gym

    space, returned = {
        "frames": (gym.spaces.Box(0, 255, (3, 2, 2), np.uint8), None),
        "cast": (gym.spaces.Box(-1e6, 1e6, (4,), np.float32), np.float64),
        "scalar": (gym.spaces.Discrete(100), int),
        "strided": (gym.spaces.Box(-1e6, 1e6, (4,), np.float32), None),
    }[case]
    made = iter(range(3))
    block = EnvBlock(lambda: _CountingEnv(space, 10 * next(made), returned), env_ids=[0, 1, 2], seeds=[1, 2, 3])
    try:
        shape, dtype = block.spec.obs_shape, np.dtype(block.spec.obs_dtype)
        obs = np.zeros((3, *shape), dtype)
        if case == "strided":  # every other row of a bigger array: not one contiguous block
            obs = np.zeros((6, *shape), dtype)[::2]
        block.reset(obs)
        for t in range(1, 4):
            rows = block.empty_rows()
            block.step(np.array([0, 1, 0]), rows, obs)
            for env in range(3):
                assert (rows["next.observation"][env] == 10 * env + t).all(), (case, t, env)
                assert (obs[env] == 10 * env + t).all(), (case, t, env)
    finally:
        block.close()
