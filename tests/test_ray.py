"""workers=ray: env hosts on a Ray cluster (two loopback nodes started here), faults, clean exits."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from components.ray.collector import RayHostsSpec, split_envs
from pipeline.plan.validate import ConfigError, validate
from tests.conftest import ROOT, compose, run_pipeline, wait_for_training

# Never beside the other Ray module (the suite runs two files at a time): both count the machine's raylets and
# hosts, and the launcher's ray.init() would join this module's cluster.
pytestmark = pytest.mark.usefixtures("ray_machine_lock")

# Before Ray is imported: a single-machine cluster advertises and binds 127.0.0.1 only; no usage stats.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

SOLVE = ["workers=ray", "trainer.total_frames=300000", "progress=false", "logger=jsonl", "logger.interval=0.5"]


def _ray_pids(name: str) -> set[int]:
    """PIDs of live processes whose command line contains ``name`` (raylet, gcs_server, ray::EnvHost)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if name in cmdline and state != "Z":
            found.add(int(entry.name))
    return found


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    """A two-node Ray cluster on 127.0.0.1 (1 CPU each, no dashboard); torn down with nothing left running."""
    from ray.cluster_utils import Cluster

    before = _ray_pids("raylet") | _ray_pids("gcs_server")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes(timeout=60)
        yield cluster.address
    finally:
        cluster.shutdown()
        deadline = time.monotonic() + 20
        while (_ray_pids("raylet") | _ray_pids("gcs_server")) - before and time.monotonic() < deadline:
            time.sleep(0.2)
        left = (_ray_pids("raylet") | _ray_pids("gcs_server")) - before
        assert not left, f"the cluster left processes running: {left}"


def test_envs_split_over_hosts_and_the_spec_checks_its_values():
    assert split_envs(8, 2) == [4, 4] and split_envs(7, 3) == [3, 2, 2]
    spec = RayHostsSpec(7, 3, 16)
    assert spec.first_envs() == [0, 3, 5] and spec.chunk_frames() == [48, 32, 32]
    with pytest.raises(ValueError, match="num_envs=2"):
        RayHostsSpec(2, 3, 16)
    with pytest.raises(ValueError, match="local_workers"):
        RayHostsSpec(4, 2, 16, local_workers="fiber")


@pytest.mark.parametrize("override, message", [
    ("ray.address=nowhere", "ray.address='nowhere': must be local, auto, host:port or ray://host:port"),
    ("ray.in_flight=0", "ray.in_flight"),
    ("collector.reset_at_each_iter=true", "not available with workers=ray"),
    ("chunking.chunks_per_worker=3", "chunking.chunks_per_worker: not used with workers=ray"),
])
def test_bad_ray_settings_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(compose("workers=ray", override), cuda_available=False)


def test_a_ray_word_no_option_allows_is_refused_while_composing():
    from hydra.errors import ConfigCompositionException

    from pipeline.__main__ import composition_error

    with pytest.raises(ConfigCompositionException) as err:
        compose("workers=ray", "ray.local_workers=fiber")
    assert composition_error(err.value) == "ray.local_workers='fiber': must be one of thread, process"


@pytest.mark.parametrize("overrides, steps", [
    ([], 16),  # auto, the process workers' rule: 64 transitions from 4 envs beat a quarter of 256 // 8
    (["trainer.frames_per_batch=4096"], 128),  # auto: a quarter of each env's share of a batch
    (["chunking=fixed", "chunking.size=7"], 7),
    (["chunking=step"], 1),
])
def test_host_chunks_follow_the_chunking_group_as_process_workers_do(overrides, steps, capsys):
    from pipeline.plan.ray import hosts_for

    spec, *_ = hosts_for(compose("workers=ray", *overrides), cluster_cpus=2)
    assert (spec.num_hosts, spec.chunk_len) == (2, steps)
    assert capsys.readouterr().err == ""


def test_the_old_ray_chunk_len_still_works_with_a_one_line_note(capsys):
    from pipeline.plan.ray import CHUNK_LEN_DEPRECATED, hosts_for

    spec, *_ = hosts_for(compose("workers=ray", "ray.chunk_len=5", "chunking=fixed", "chunking.size=9"), cluster_cpus=2)
    assert spec.chunk_len == 5
    assert capsys.readouterr().err.strip() == CHUNK_LEN_DEPRECATED


def test_without_the_extra_a_user_gets_one_line_saying_how_to_install_it(tmp_path):
    # sys.modules["ray"] = None: what an environment without Ray looks like to importlib
    code = ("import sys, runpy; sys.modules['ray'] = None; sys.argv = ['pipeline', 'workers=ray', "
            f"'hydra.run.dir={tmp_path / 'run'}']; runpy.run_module('pipeline', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "config error: workers=ray needs the ray extra: pip install -e '.[ray]' (Ray >= 2.60)"


def test_an_unreachable_cluster_is_one_line_and_nothing_is_written(tmp_path):
    done = run_pipeline(["workers=ray", "ray.address=127.0.0.1:1", f"hydra.run.dir={tmp_path / 'run'}"],
                        cwd=tmp_path, timeout=180)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("config error: ray.address='127.0.0.1:1': cannot connect")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_local_cluster_is_started_for_the_run_and_gone_after_it(tmp_path):
    before = _ray_pids("raylet") | _ray_pids("gcs_server")
    run_dir = tmp_path / "local"
    # sync_collection: the hosts' workers are parked (remotely) during every update
    pools = tmp_path / "pools"  # what each process's thread pools held (components/threads.py)
    # a fixed budget: solving CartPole on Ray is test_cartpole_is_solved_with_env_hosts_on_both_nodes_of_a_cluster
    done = run_pipeline(["workers=ray", "trainer.total_frames=4096", "trainer.target_return=null", "progress=false",
                         "logger=jsonl", "ray.address=local", "trainer.sync_collection=true", f"hydra.run.dir={run_dir}"],
                        cwd=tmp_path, timeout=280, env={"RLPIPELINE_POOLS_DIR": str(pools)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "started here (127.0.0.1 only" in done.stdout
    assert _rows(run_dir)[-1]["summary"]["frames"] == 4096
    assert "each env host 1" in done.stdout
    hosts = [json.loads(p.read_text()) for p in pools.glob("ray-host-*.json")]
    assert hosts, sorted(p.name for p in pools.glob("*"))
    for host in hosts:  # one thread per host, whatever Ray started its process with
        assert host["torch"] == 1 and {lib["num_threads"] for lib in host["libraries"]} == {1}, host
    deadline = time.monotonic() + 15
    while (_ray_pids("raylet") | _ray_pids("gcs_server")) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not (_ray_pids("raylet") | _ray_pids("gcs_server")) - before


def test_hosts_the_cluster_cannot_place_fail_in_one_line_after_the_start_timeout(two_nodes, tmp_path):
    done = run_pipeline(["workers=ray", f"ray.address={two_nodes}", "ray.num_actors=2", "ray.num_cpus_per_actor=4",
                         "ray.start_timeout=3", "progress=false", f"hydra.run.dir={tmp_path / 'run'}"],
                        cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ray worker(s) 0, 1 not running after 3 s: the cluster cannot place 2 host(s) "
                           "of 4 CPU(s) (2 CPU(s) in the cluster)"), last


def test_cartpole_is_solved_with_env_hosts_on_both_nodes_of_a_cluster(two_nodes, tmp_path):
    run_dir = tmp_path / "two-nodes"
    done = run_pipeline([*SOLVE, f"ray.address={two_nodes}", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "joined" in done.stdout and "2 node(s)" in done.stdout
    rows = _rows(run_dir)
    assert rows[-1]["summary"]["stop_reason"] == "target_return"
    last = [r for r in rows if "summary" not in r][-1]
    per_node = {k: v for k, v in last.items() if k.startswith("collector/ray/node_frames/")}
    assert len(per_node) == 2 and all(v > 0 for v in per_node.values()), per_node
    assert sum(per_node.values()) >= last["frames"] - 2 * 2 * 64  # what was still in flight or unassembled
    versions = [r["collector/policy_version"] for r in rows if "collector/policy_version" in r]
    assert versions == sorted(versions) and versions[-1] > 10
    # one batch made ahead at most (the requests are bounded): every request out ran two ahead, lag 2.0-2.1
    lags = sorted(r["collector/policy_lag_mean"] for r in rows if "collector/policy_lag_mean" in r)
    assert lags and lags[len(lags) // 2] < 1.85, lags
    deadline = time.monotonic() + 10
    while _ray_pids("ray::EnvHost") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ray_pids("ray::EnvHost"), "the run's env hosts outlived it"


def _start(args: list[str], run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "pipeline", *args, "trainer.total_frames=100000000",
                             "trainer.target_return=null", "progress=false", "logger=jsonl", "logger.interval=0.5",
                             f"hydra.run.dir={run_dir}"],
                            cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def test_a_killed_env_host_fails_the_run_in_one_line_within_seconds(two_nodes, tmp_path):
    proc = _start(["workers=ray", f"ray.address={two_nodes}", "workers.max_restarts=0"], tmp_path / "killed")
    try:
        wait_for_training(proc)
        hosts = sorted(_ray_pids("ray::EnvHost"))
        assert len(hosts) == 2, hosts
        os.kill(hosts[0], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, f"exit {proc.returncode} {took:.1f} s after the kill: {err[-3000:]}"
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ray worker ") and "its actor died" in last, err[-3000:]
    assert took < 5.0, f"the run noticed the dead host after {took:.1f} s"


def test_a_killed_env_host_is_restarted_and_the_run_goes_on(two_nodes, tmp_path):
    run_dir = tmp_path / "restarted"
    proc = _start(["workers=ray", f"ray.address={two_nodes}", "workers.max_restarts=2"], run_dir)
    try:
        wait_for_training(proc)
        victim = sorted(_ray_pids("ray::EnvHost"))[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        restarted = False
        while time.monotonic() < deadline and not restarted:
            time.sleep(0.5)
            rows = [r for r in _rows(run_dir) if "summary" not in r] if (run_dir / "metrics.jsonl").exists() else []
            restarted = any(r.get("collector/worker_restarts", 0) >= 1 for r in rows)
            assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert restarted, "no restart was logged within 60 s"
        frames_then = rows[-1]["frames"]
        time.sleep(3)
        rows = [r for r in _rows(run_dir) if "summary" not in r]
        assert rows[-1]["frames"] > frames_then, "collection did not go on after the restart"
        assert victim not in _ray_pids("ray::EnvHost") and len(_ray_pids("ray::EnvHost")) == 2
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert "restarting it with fresh envs" in out
    deadline = time.monotonic() + 10
    while _ray_pids("ray::EnvHost") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ray_pids("ray::EnvHost"), "SIGTERM left env hosts running on the cluster"



def test_dqn_fills_replay_from_env_hosts(two_nodes, tmp_path):
    run_dir = tmp_path / "dqn"
    done = run_pipeline(["workers=ray", f"ray.address={two_nodes}", "trainer=dqn", "replay=uniform",
                         "trainer.total_frames=3000", "progress=false", "logger=jsonl", f"hydra.run.dir={run_dir}"],
                        cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(run_dir)
    assert rows[-1]["summary"]["frames"] == 3000
    assert any("replay/size" in r for r in rows), rows[-2]


def test_flat_spaces_and_own_models_reach_env_hosts(two_nodes, tmp_path):
    """Each host rebuilds the env and the model by itself: a Dict observation with one-hot inputs and an info
    mask (the env raises on a masked action), a user's class, an env set (a host's envs span both tasks).

    The joined cluster's workers import this checkout's tests package through ray.runtime_env's PYTHONPATH.
    """
    reach = f"+ray.runtime_env.env_vars={{PYTHONPATH:'{ROOT}'}}"
    for name, overrides in (
            # the default model's one-hot input for the Discrete goal leaf, the tree and the mask rebuilt on the host
            ("masked-dict", ["env.factory._target_=tests.fakes.TreeEnvFactory", "~env.factory.id",
                             "+env.factory.mask=info"]),
            # a user's class, imported by the host (factorised actions convert in the env block every
            # placement shares: tests/test_spaces.py), over an env set of 3 + 5 envs (one a closure: cloudpickle)
            ("own-model-env-set", ["model._target_=tests.fakes.TinyActorCritic", "+model.width=16", "env.num_envs=8",
                                   "env.factories=[{factory:{_target_:components.envs.GymEnvFactory,id:CartPole-v1,"
                                   "kwargs:{max_episode_steps:20}},count:3,task:short},"
                                   "{factory:{_target_:tests.fakes.closure_env_factory,env_id:CartPole-v1},"
                                   "count:5,task:long,seed_offset:1000}]"])):
        run_dir = tmp_path / name
        # Hosts deliver in arrival order: on a fast machine the host of the long task alone once delivered all
        # 2,048 frames before the other's first chunk came (fresh-clone CI, 2026-12-03); 8,192 leaves room for both.
        frames = 8192 if name == "own-model-env-set" else 2048
        done = run_pipeline(["workers=ray", f"ray.address={two_nodes}", reach, *overrides,
                             f"trainer.total_frames={frames}", "trainer.target_return=null", "progress=false",
                             "logger=jsonl", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=240)
        assert done.returncode == 0, (name, done.stderr[-3000:])
        rows = _rows(run_dir)
        assert rows[-1]["summary"]["frames"] == frames, name
        if name == "own-model-env-set":
            # a row before a task's first finished episode holds null for it
            short = [r["episode/short/return_mean"] for r in rows if r.get("episode/short/return_mean") is not None]
            long = [r["episode/long/return_mean"] for r in rows if r.get("episode/long/return_mean") is not None]
            assert short and long and max(short) <= 20, (short, long)


def test_a_sigkilled_driver_leaves_no_host_on_a_joined_cluster(two_nodes, tmp_path):
    proc = _start(["workers=ray", f"ray.address={two_nodes}"], tmp_path / "sigkilled")
    try:
        wait_for_training(proc)
        assert len(_ray_pids("ray::EnvHost")) == 2
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    deadline = time.monotonic() + 30
    while _ray_pids("ray::EnvHost") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ray_pids("ray::EnvHost"), "the hosts of a SIGKILLed driver outlived it by 30 s"


def test_the_benchmark_measures_ours_ray_and_the_scaling_model_reads_its_report(two_nodes, tmp_path):
    """On a running cluster (``ours:ray@address=``, ``--address``): starting a loopback one in the trial and again in
    the scaling model cost this test a minute, and test_a_local_cluster_is_started_for_the_run_and_gone_after_it
    covers ``ray.address=local``."""
    out = tmp_path / "bench"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    contender = f"ours:ray@address={two_nodes}"
    done = subprocess.run([sys.executable, "-m", "pipeline.bench", f"contenders=['{contender}']", "repeats=1",
                           "seconds=1", "warmup=0.5", "num_envs=8", f"hydra.run.dir={out}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "bench_cartpole.json").read_text())
    trial = [t for t in report["trials"] if t["contender"] == contender][0]
    assert trial["ok"] and trial["fps"] > 0 and trial["graph"]["workers"] == "ray"
    assert trial["ray_driver_us_per_frame"] > 0 and trial["ray_bytes_per_frame"] > 0
    assert f"ray.address={two_nodes}" in trial["command"]
    done = subprocess.run([sys.executable, "-m", "pipeline.bench.ray_scale", str(out / "bench_cartpole.json"),
                           "--nodes", "1", "4", "--address", two_nodes], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 4 |")]
    assert len(rows) == 2 and all(("hosts" in r) or ("driver" in r) or ("network" in r) for r in rows)


def test_a_host_that_failed_to_start_says_why_not_that_it_was_killed():
    """An exception in a host's __init__ (its envs, its code) is the cause, not "process killed or node lost"."""
    import traceback

    from ray import exceptions
    from ray.exceptions import ActorDiedError, RayTaskError

    from components.collector.failures import CollectorError, Failure, FailureKind
    from components.ray.errors import ray_failure

    try:
        raise NameError("name 'FieldSpec' is not defined")
    except NameError as err:
        init_error = RayTaskError("EnvHost.__init__", traceback.format_exc(), err)
    died = ActorDiedError(cause=init_error)
    assert ray_failure(died, exceptions) == Failure(
        "its env host failed to start: NameError: name 'FieldSpec' is not defined", FailureKind.BUILD)
    assert ray_failure(ActorDiedError(), exceptions) == Failure("its actor died (process killed or node lost)")
    assert ray_failure(init_error, exceptions) == Failure("NameError: name 'FieldSpec' is not defined")
    # a host's own collector error keeps its line and its kind, through the pickling Ray does
    wrapped = RayTaskError("EnvHost.collect", "tb", pickle.loads(pickle.dumps(
        CollectorError("env worker 0 failed: env 3 returned a non-finite reward nan\nmore", FailureKind.NON_FINITE))))
    assert ray_failure(wrapped, exceptions) == Failure("env worker 0 failed: env 3 returned a non-finite reward nan",
                                                       FailureKind.NON_FINITE)


def test_a_recurrent_policy_trains_with_env_hosts_carrying_each_envs_state(two_nodes, tmp_path):
    """model.rnn through Ray hosts: each host's worker loop carries its envs' LSTM state in its requests."""
    run_dir = tmp_path / "lstm"
    done = run_pipeline(["workers=ray", f"ray.address={two_nodes}", "env=no_velocity", "trainer.total_frames=4096",
                         "trainer.target_return=null", "progress=false", "logger=jsonl", f"hydra.run.dir={run_dir}"],
                        cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "memory    lstm core, 1 x 64" in done.stdout
    rows = _rows(run_dir)
    assert rows[-1]["summary"]["frames"] == 4096
    trained = [r for r in rows[:-1] if "train/value_loss" in r]
    assert trained and all(r["train/value_loss"] == r["train/value_loss"] for r in trained), "finite losses"


def test_the_scaling_model_on_an_unreachable_cluster_is_one_line_exit_2(tmp_path):
    report = {"trials": [{"contender": "ours:ray@address=127.0.0.1:1", "ok": True, "ray_driver_us_per_frame": 1.0,
                          "ray_bytes_per_frame": 100}],
              "limit": {"cpu_bound_fps": 1000, "cpus": 2}, "machine": {"cpu": "x", "cpus": 2},
              "workload": {"name": "cartpole", "overrides": ["env=cartpole", "model.hidden=[16]"], "num_envs": 4,
                           "frames_per_batch": 64}}
    path = tmp_path / "bench_cartpole.json"
    path.write_text(json.dumps(report))
    done = subprocess.run([sys.executable, "-m", "pipeline.bench.ray_scale", str(path), "--address", "127.0.0.1:1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot connect" in lines[0] and "Traceback" not in done.stderr, done.stderr
