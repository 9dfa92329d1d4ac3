"""Config fuzz: bad overrides on the command line, each one line and exit 2 before the plan."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

BAD = [
    "server.max_batch_size=0", "server.min_batch_size=0", "server.min_batch_size=999",
    "server.timeout=-1", "server.num_threads=0", "server.stats_reservoir=0", "server.engine=jax",
    "server.backend=gpu", "server.static_batch_size=8", "env.num_envs=0",
    "env.envs_per_worker=0", "env.id=NoSuchEnv-v0", "env.id=CartPol-v1", "workers.splits=0", "workers.nice=25",
    "workers.step_timeout=0", "workers.concurrent_envs=maybe", "workers.affinity=[[0]]", "transport.kind=wormhole",
    "device.policy_device=tpu", "device.policy_device=cuda", "device.trainer_device=cuda:3",
    "device.storing_device=cuda", "chunking.mode=sometimes", "chunking.chunks_per_worker=0",
    "chunking.chunks_per_worker=2", "collector.stall_timeout=0",
    "collector.policy_version=-1", "collector.driver_affinity=[99]", "collector.post_collect_hook=no.such.hook",
    "trainer.frames_per_batch=0", "trainer.total_frames=0", "trainer.target_window=0",
    "trainer.lr=0", "trainer.lr=inf", "trainer.gamma=0", "trainer.gamma=1.5",
    "trainer.gae_lambda=2", "trainer.clip_coef=0", "trainer.epochs=0", "trainer.minibatches=0",
    "trainer.minibatches=100000", "trainer.ent_coef=-1", "trainer.max_policy_lag=-1", "trainer.max_grad_norm=-1",
    "trainer.name=dqn", "trainer.name=a2c", "replay=uniform", "logger.interval=0", "logger.mode=sometimes",
    "torch_threads=0", "seed=-1", "model.encoder=resnet", "model.activation=gelu", "model.hidden=[]",
    "model.hidden=[0]", "trainer.frames_per_batch=100000000000", "hydra.run.dir=/proc/nope",
    "env.factory._target_=no.such.Factory", "logger.sinks=[jsonl,mlflow]", "logger.sinks=[wandb,wandb]",
    "logger.wandb_timeout=0", "sweep.objective=loss", "sweep.direction=up", "server.max_restarts=-1",
    "trainer.nan_policy=ignore", "trainer.eval_interval=0", "trainer.eval_episodes=0", "trainer.target_metric=best",
    "trainer.target_metric=eval", "env=atari model.obs_norm=true",
    # what Hydra itself refuses while composing: a wrong type, an unknown key or option, bad syntax
    "trainer.total_frames=abc", "trainer.nope=1", "env=nope", "workers=gpu", "trainer.lr=[1",
]
DQN_BAD = ["replay.capacity=0", "replay.alpha=-1", "replay.beta=2", "replay.eps=0", "replay.storage=tape",
           "replay.frame_dedup=maybe", "replay.frame_dedup=true", "replay.max_policy_lag=-2", "trainer.tau=0",
           "trainer.batch_size=0", "trainer.batch_size=1000000", "trainer.n_step=0", "trainer.eps_start=2",
           "trainer.eps_fraction=0", "replay.storage=disk replay.capacity=10000000000", "model.obs_norm=true"]
CASES = [o.split() for o in BAD] + [["trainer=dqn", "replay=uniform", *o.split()] for o in DQN_BAD]


#: each kind of refusal once more through a real ``python -m pipeline`` (the rest run forked, tests/cli_forks.py)
REAL = [["trainer.nope=1"], ["env.num_envs=0"], ["env.id=NoSuchEnv-v0"], ["hydra.run.dir=/proc/nope"],
        ["trainer=dqn", "replay=uniform", "replay.capacity=0"]]


def _env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}


def _with_run_dir(args: list[str], tmp) -> list[str]:  # noqa: ANN001
    if any(a.startswith("hydra.run.dir") for a in args):
        return args
    return [*args, f"hydra.run.dir={tmp / ('r' + str(abs(hash(tuple(args)))))}"]


def _run(args: list[str], tmp) -> dict:  # noqa: ANN001
    done = subprocess.run([sys.executable, "-m", "pipeline", *_with_run_dir(args, tmp)], cwd=tmp, env=_env(),
                          capture_output=True, text=True, timeout=240)
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def _failures(results: list[tuple[list[str], dict]]) -> list[str]:
    failures = []
    for args, result in results:
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        ok = (result["returncode"] == 2 and len(lines) == 1 and lines[0].startswith("config error: ")
              and "plan:" not in result["stdout"] and "Traceback" not in result["stdout"] + result["stderr"])
        if not ok:
            failures.append(f"{' '.join(args)} -> exit {result['returncode']}, stdout {result['stdout'][-300:]!r}, "
                            f"stderr {result['stderr'][-600:]!r}")
    return failures


@pytest.mark.timeout(900)
def test_at_least_fifty_bad_overrides_are_each_one_line_and_exit_2_before_the_plan(tmp_path):
    from tests.cli_forks import run_forked

    assert len(CASES) >= 50
    forked = run_forked([_with_run_dir(args, tmp_path) for args in CASES], tmp_path, _env())
    failures = _failures(list(zip(CASES, forked)))
    with ThreadPoolExecutor(max_workers=2) as pool:
        real = list(pool.map(lambda args: (args, _run(args, tmp_path)), REAL))
    failures += [f"(python -m pipeline) {line}" for line in _failures(real)]
    assert not failures, "\n".join(failures)
    assert not list(tmp_path.glob("*/metrics.jsonl")), "a refused run wrote metrics"


def test_the_forked_runs_see_what_a_fresh_interpreter_sees(tmp_path):
    """The fork helper is a faithful stand-in: a good run's plan, a bad one's line, the same exit codes."""
    from tests.cli_forks import run_forked

    cases = [_with_run_dir(["trainer.total_frames=2048", "env.num_envs=2", "workers=thread", "server=inline",
                            "trainer.target_return=null", "logger.sinks=[jsonl]"], tmp_path),
             _with_run_dir(["env.num_envs=0"], tmp_path)]
    good, bad = run_forked(cases, tmp_path, _env())
    assert good["returncode"] == 0, good["stderr"][-2000:]
    assert "plan:" in good["stdout"]
    assert list(tmp_path.glob("*/metrics.jsonl")), "the good forked run wrote no metrics"
    assert bad["returncode"] == 2 and bad["stderr"].startswith("config error: ")
