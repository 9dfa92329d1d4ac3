"""An env (or a policy) that returns values off its spec is named with what it returned against what the spec says.

Scalar-like values gymnasium accepts are accepted: a numpy scalar or a
shape-(1,) reward, np.bool_ flags, a float64 or list observation of the
spec's shape.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from components.collector.env_block import EnvBlock
from components.envs import GymEnvFactory
from tests.conftest import run_pipeline
from tests.fakes import SpecBreakingEnvFactory

PROMISE = r"the observation space promises shape \(4,\) float32$"


def _step(block: EnvBlock, steps: int) -> list[dict[str, np.ndarray]]:
    """Reset, then ``steps`` steps with alternating actions; every step's rows."""
    obs = np.zeros((len(block), 4), np.float32)
    block.reset(obs)
    out = []
    for t in range(steps):
        rows = block.empty_rows()
        block.step(np.full(len(block), t % 2, np.int64), rows, obs)
        out.append(rows)
    return out


def _violation(fault: str, at_step: int = 5, steps: int = 40) -> str:
    block = EnvBlock(SpecBreakingEnvFactory(at_step=at_step, fault=fault), env_ids=[6, 7], seeds=[1, 2])
    try:
        with pytest.raises(ValueError) as info:
            _step(block, steps)
    finally:
        block.close()
    return str(info.value)


def test_an_observation_that_changes_shape_mid_run_names_the_env_the_leaf_and_both_shapes():
    message = _violation("obs_shape")
    assert re.fullmatch(r"env 6 broke its spec at its step 5: its observation has shape \(5,\) float32; " + PROMISE,
                        message), message


@pytest.mark.parametrize(("fault", "said"), [
    ("reward_2", r"its reward has shape \(2,\) float64; a reward must be a number"),
    ("reward_str", r"its reward is a str '1.0'; a reward must be a number"),
    ("obs_object", r"its observation has shape \(4,\) object \(not numeric\); " + PROMISE),
    ("obs_scalar", r"its observation is a numpy float32 scalar \(shape \(\)\); " + PROMISE),  # numpy broadcasts it
    ("obs_dict", r"its observation is a dict \(keys 'state'\); " + PROMISE),
    ("terminated_pair", r"its terminated has shape \(2,\) bool; terminated must be a bool"),
])
def test_a_value_off_the_spec_is_one_line_naming_what_it_returned_and_what_the_spec_says(fault, said):
    message = _violation(fault)
    assert message.startswith("env 6 broke its spec at its step 5: ") and "\n" not in message, message
    assert re.search(said, message), message


@pytest.mark.parametrize(("at_step", "when"), [(1, "on its first reset"), (2, r"on the reset after its step \d+")])
def test_a_reset_observation_of_another_shape_is_named(at_step, when):
    message = _violation("reset_obs_shape", at_step=at_step, steps=200)
    assert re.fullmatch(rf"env [67] broke its spec {when}: its observation has shape \(5,\) float32; " + PROMISE,
                        message), message


@pytest.mark.parametrize("fault", ["reward_1", "reward_np", "terminated_np", "obs_float64", "obs_list"])
def test_scalar_like_and_castable_values_are_accepted_as_gymnasium_accepts_them(fault):
    """Each gives exactly the transitions of the plain env: same seeds, same actions."""
    broken = EnvBlock(SpecBreakingEnvFactory(at_step=1, fault=fault), env_ids=[0, 1], seeds=[1, 2])
    plain = EnvBlock(GymEnvFactory("CartPole-v1"), env_ids=[0, 1], seeds=[1, 2])
    try:
        got, want = _step(broken, 60), _step(plain, 60)
    finally:
        broken.close()
        plain.close()
    assert any(r["next.done"].any() for r in want), "episodes end: the flags are compared"
    for t, (a, b) in enumerate(zip(got, want)):
        for key in b:
            assert np.array_equal(a[key], b[key]), f"step {t}: {key}"


@pytest.mark.parametrize(("actions", "said"), [
    (np.array([0.0, 1.0]), r"has shape \(2,\) float64"),
    (np.array([[0], [1]]), r"has shape \(2, 1\) int64"),
])
def test_actions_off_the_action_space_are_named(actions, said):
    block = EnvBlock(GymEnvFactory("CartPole-v1"), env_ids=[4, 5], seeds=[1, 2])
    try:
        obs = np.zeros((2, 4), np.float32)
        block.reset(obs)
        with pytest.raises(ValueError, match=r"^the policy's action batch for envs 4-5 " + said +
                           r"; the action space promises shape \(2,\) integer \(Discrete\(2\)\)$"):
            block.step(actions, block.empty_rows(), obs)
    finally:
        block.close()


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_collector_fails_with_the_violation_when_no_restart_is_left(concurrent):
    from components.collector.collector import AsyncBatchedCollector, CollectorError, GraphSpec
    from components.models import ModelSpec

    graph = GraphSpec("thread", "thread", num_envs=2, envs_per_worker=1 if concurrent else 2, chunk_len=2,
                      concurrent_envs=concurrent)
    collector = AsyncBatchedCollector(SpecBreakingEnvFactory(at_step=10, fault="reward_2"),
                                      ModelSpec("components.models.ActorCritic", {"hidden": [16]}), graph,
                                      frames_per_batch=16, total_frames=-1, seed=4)
    try:
        with pytest.raises(CollectorError, match=r"env [01] broke its spec at its step 10: its reward has shape "
                                                 r"\(2,\) float64"):
            collector.start()
            for _ in range(200):
                collector.next_batch()
    finally:
        collector.shutdown()


def _pipeline_args(tmp_path, fault: str, restarts: int, once: bool) -> list[str]:  # noqa: ANN001
    args = ["env.factory._target_=tests.fakes.SpecBreakingEnvFactory", "+env.factory.at_step=30",
            f"+env.factory.fault={fault}", "workers=process", "env.num_envs=2", "env.envs_per_worker=2",
            "transport=slots",  # no layout probe: it would step the env (and meet the fault) first
            f"workers.max_restarts={restarts}", "trainer.total_frames=1000", "trainer.target_return=null",
            "logger=jsonl", "logger.interval=0.5", "progress=false", f"hydra.run.dir={tmp_path / 'run'}"]
    return args + ([f"+env.factory.once={tmp_path / 'marker'}"] if once else [])


def test_a_run_whose_env_changes_its_observation_shape_ends_with_one_line_naming_it(tmp_path):
    result = run_pipeline(_pipeline_args(tmp_path, "obs_shape", restarts=0, once=False), cwd=tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert re.search(r"env [01] broke its spec at its step 30: its observation has shape \(5,\) float32; "
                     + PROMISE, last), result.stderr[-3000:]
    assert "could not broadcast" not in result.stderr


def test_a_run_with_restarts_left_replaces_the_worker_of_an_env_off_its_spec_and_goes_on(tmp_path):
    result = run_pipeline(_pipeline_args(tmp_path, "reward_2", restarts=1, once=True), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"warning: env worker \d .*restarted with fresh envs .*"
                     r"env [01] broke its spec at its step 30: its reward has shape \(2,\) float64", result.stderr)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["summary"]["frames"] == 1000
    assert max(r.get("collector/worker_restarts", 0) for r in rows[:-1]) == 1


def test_flags_and_rewards_take_what_gymnasium_takes_and_refuse_the_rest():
    from components.collector.spec_checks import OffSpec, check_flag, check_reward

    for flag in (True, np.bool_(False), 1, np.int64(0), np.array(True), np.array([False])):
        assert check_flag(flag, "terminated") is bool(flag)
    for flag in (2, 1.0, "False", None, np.array([True, False])):
        with pytest.raises(OffSpec, match="^its terminated "):
            check_flag(flag, "terminated")
    for reward in (1, 1.5, True, np.float32(2.0), np.int64(3), np.array(4.0), np.array([5.0])):
        assert check_reward(reward) == float(np.asarray(reward).reshape(()))
    for reward in ("1.0", None, [1.0], 1j, np.array([[1.0]]), np.array(["1.0"])):
        with pytest.raises(OffSpec, match="^its reward "):
            check_reward(reward)


def test_a_discrete_observation_space_takes_python_ints_and_refuses_floats():
    block = EnvBlock(GymEnvFactory("FrozenLake-v1"), env_ids=[0, 1], seeds=[1, 2])
    try:
        obs = np.zeros(2, np.int64)
        block.reset(obs)
        for _ in range(50):
            rows = block.empty_rows()
            block.step(np.array([1, 2]), rows, obs)
        assert block.env_step.tolist() == [50, 50]
        # past its first step the block steps the env under gym.make's wrappers: the env itself breaks its spec
        block._envs[1].unwrapped.step = lambda action: (3.0, 0.0, False, False, {})  # a float for a Discrete space
        with pytest.raises(ValueError, match=r"^env 1 broke its spec at its step 51: its observation is a float "
                                             r"of shape \(\) float64 \(no same-kind cast to int64\); "
                                             r"the observation space promises shape \(\) int64$"):
            block.step(np.array([1, 2]), block.empty_rows(), obs)
    finally:
        block.close()


def test_a_castable_dtype_once_accepted_still_has_its_shape_checked_and_other_dtypes_refused():
    block = EnvBlock(SpecBreakingEnvFactory(at_step=1, fault="obs_float64"), env_ids=[0], seeds=[1])
    try:
        _step(block, 5)  # float64 observations of a float32 space: cast, and remembered as castable
        env = block._envs[0]
        env.step = lambda action: (np.zeros(5), 1.0, False, False, {})
        with pytest.raises(ValueError, match=r"its observation has shape \(5,\) float64; " + PROMISE):
            block.step(np.array([0]), block.empty_rows(), np.zeros((1, 4), np.float32))
        env.step = lambda action: (np.zeros(4, object), 1.0, False, False, {})
        with pytest.raises(ValueError, match=r"its observation has shape \(4,\) object \(not numeric\)"):
            block.step(np.array([0]), block.empty_rows(), np.zeros((1, 4), np.float32))
    finally:
        block.close()
