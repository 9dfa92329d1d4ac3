"""Env sets: several factories in one run (env.factories), seeded and named per task, one policy over all."""

from __future__ import annotations

import json

import numpy as np
import pytest

from components.collector.env_block import EnvBlock
from components.env_set import EnvSet, EnvSetEntry
from pipeline.plan.validate import ConfigError
from tests.conftest import compose, run_pipeline
from tests.fakes import MatchEnv, MatchEnvFactory

CARTPOLE = "{_target_:components.envs.GymEnvFactory,id:CartPole-v1"
SHORT_AND_LONG = (f"env.factories=[{{factory:{CARTPOLE},kwargs:{{max_episode_steps:20}}}},count:4,task:short}},"
                  f"{{factory:{{_target_:tests.fakes.closure_env_factory,env_id:CartPole-v1}},count:4,task:long,"
                  "seed_offset:1000}]")


def test_each_env_id_is_built_and_seeded_by_its_entry():
    env_set = EnvSet([EnvSetEntry(MatchEnvFactory("multi_discrete"), 2, "a"),
                      EnvSetEntry(MatchEnvFactory("multi_discrete"), 2, "b", seed_offset=100)])
    block = EnvBlock(env_set, [0, 1, 2, 3], [5, 6, 7, 8])
    obs = np.zeros((4, 3), np.int64)
    block.reset(obs)
    for env_id, seed in zip(range(4), [5, 6, 107, 108]):
        assert np.array_equal(obs[env_id], MatchEnv().reset(seed=seed)[0]), env_id
    assert env_set.task_of().tolist() == [0, 0, 1, 1] and env_set.tasks == ("a", "b")
    with pytest.raises(ValueError, match="task names must differ"):
        EnvSet([EnvSetEntry(int, 1, "a"), EnvSetEntry(int, 1, "a")])


@pytest.mark.parametrize(("overrides", "message"), [
    ([f"env.factories=[{{factory:{CARTPOLE}}},count:3}}]"],
     "env.num_envs=8: env.factories make 3 envs (task0 3); set env.num_envs=3"),
    ([f"env.factories=[{{factory:{CARTPOLE}}},count:4}},"
      "{factory:{_target_:components.envs.GymEnvFactory,id:Acrobot-v1},count:4}]"],
     "env.factories[1] (task1): its envs' spaces differ from task0's"),
    ([f"env.factories=[{{factory:{CARTPOLE}}},count:8,weight:2}}]"], "env.factories[0]: needs factory"),
    ([f"env.factories=[{{factory:{CARTPOLE}}},count:0}}]"], "env.factories[0].count=0: must be an integer >= 1"),
])
def test_a_wrong_env_set_is_one_line(overrides, message):
    from pipeline.plan.inputs import build_env

    with pytest.raises(ConfigError) as err:
        build_env(compose(*overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_each_ray_host_builds_its_range_of_an_env_set_with_its_tasks_seeds():
    """A host's envs are a slice of the set: env ids from 0, each with the factory and seed offset it had."""
    env_set = EnvSet([EnvSetEntry(MatchEnvFactory("multi_discrete"), 3, "a"),
                      EnvSetEntry(MatchEnvFactory("multi_binary"), 3, "b", seed_offset=100)])
    host = env_set.slice(2, 3)  # global ids 2, 3, 4
    assert host.tasks == ("a", "b") and host.task_of().tolist() == [0, 1, 1]
    assert [host.seed_of(i, 5) for i in range(3)] == [env_set.seed_of(g, 5) for g in (2, 3, 4)] == [5, 105, 105]
    assert [host.for_env(i) for i in range(3)] == [env_set.for_env(g) for g in (2, 3, 4)]
    assert env_set.slice(3, 3).tasks == ("b",)
    with pytest.raises(ValueError, match="not all in this set of 6"):
        env_set.slice(4, 3)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_two_tasks_train_together_and_log_their_episodes_apart(tmp_path, workers):
    """A closure factory (the long task) reaches process workers by value; the short task's episodes end at 20."""
    run_dir = tmp_path / "run"
    proc = run_pipeline([SHORT_AND_LONG, f"workers={workers}", "trainer.total_frames=4096", "trainer.target_return=null",
                         "eval.interval=2048", "eval.episodes=4", "logger=jsonl",
                         "logger.interval=0.2", f"hydra.run.dir={run_dir}"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tasks     2 task(s), one policy: short 4 env(s), long 4 env(s) (seeds +1000)" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = rows[-1]["summary"]
    assert summary["episode/short/count"] > 0 and summary["episode/long/count"] > 0
    assert summary["episode/short/count"] + summary["episode/long/count"] == summary["episode/count"]
    lengths = [r["episode/short/length_mean"] for r in rows[:-1] if r.get("episode/short/count")]
    assert lengths and max(lengths) <= 20, "the short task's time limit"
    assert summary["episode/short/return_mean"] <= 20
    evaluated = [r for r in rows[:-1] if "eval/short/return_mean" in r]
    assert evaluated and all(r["eval/short/return_mean"] <= 20 for r in evaluated), "evaluation took both tasks"
    assert all("eval/long/return_mean" in r for r in evaluated)
