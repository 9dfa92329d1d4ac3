"""python -m pipeline.bench runs contenders side by side and writes a report."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time

import pytest

from pipeline.bench.bare import run_bare
from pipeline.bench.ours import layout_overrides, layout_words, ours_overrides, plan_for
from pipeline.bench.harness import SCALE_ENVS, apply_scale, format_report, format_sweep, run_bench, trial_plan
from tests.conftest import run_pipeline  # noqa: F401 - shared fixtures live there

WORKLOAD = {"name": "cartpole", "overrides": ["env=cartpole", "model.hidden=[16]"], "num_envs": 4,
            "frames_per_batch": 64}


def _faulty(**kwargs: object) -> dict:
    """WORKLOAD with the env swapped for tests.fakes.FaultyEnvFactory(**kwargs), by overrides as a user would."""
    swap = ["env.factory._target_=tests.fakes.FaultyEnvFactory"]
    return {**WORKLOAD, "overrides": [*WORKLOAD["overrides"], *swap, *(f"+env.factory.{k}={v}" for k, v in kwargs.items())]}


def test_contender_names_are_override_lists_planned_by_the_runners_rules():
    assert layout_overrides("ours:auto") == []
    assert layout_overrides("ours:process/none/inline/auto") == ["workers=process", "server=inline", "transport=slots",
                                                                 "chunking=auto"]
    _, planned, _ = plan_for(ours_overrides("ours:process/slots/process/auto", WORKLOAD, 64))
    g = planned.plan.graph
    assert (g.workers, g.server, g.splits, g.num_envs) == ("process", "process", 2, 64)
    assert g.chunk_len * g.envs_per_worker >= 64
    _, planned, _ = plan_for(ours_overrides("ours:process/slots/thread/step@epw=4,splits=1", WORKLOAD, 8))
    g = planned.plan.graph
    assert (g.envs_per_worker, g.splits, g.chunk_len) == (4, 1, 1)
    assert layout_overrides("ours:ray") == ["workers=ray", "ray.address=local"]
    assert layout_overrides("ours:ray@address=10.0.0.1:6379") == ["workers=ray", "ray.address=10.0.0.1:6379"]
    for bad in ("ours:process/slots/inline/auto", "ours:gpu/slots/thread/auto", "ours:thread/slots/thread/auto@x=1",
                "ours:thread/slots", "ours:ray@address=", "ours:ray@epw=4"):
        with pytest.raises(ValueError):
            layout_overrides(bad)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("contenders,names", [
    ("contenders=[gym_sync,gym_snyc]", "unknown contender 'gym_snyc'"),
    ("contenders=['ours:ray@epw=4']", "ours:ray takes one option"),
    ("contenders=[ours:gpu/slots/thread/auto+lstm]", "workers one of"),
    ("contenders=everything", "'all', 'default' or a list"),
    ("repeats=abc", "repeats='abc': must be an integer >= 1"),
    ("sweep_envs=[8,0]", "sweep_envs=0: must be an integer >= 1"),
    ("contenders=[ours:process/none/inline/auto@epw=8]", "quote a contender with options"),  # Hydra's grammar
    ("bench_workload=pongg", "Could not find 'bench_workload/pongg' (available: cartpole, frames, pong, waiting)"),
])
def test_a_setting_no_trial_can_run_with_is_one_line_and_exit_2_before_any_trial(tmp_path, contenders, names):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pipeline.bench", contenders, f"hydra.run.dir={tmp_path}/out"],
                          capture_output=True, text=True, timeout=50, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: ") and names in lines[0], proc.stderr
    assert "costs:" not in proc.stdout  # not even the cost probe ran


@pytest.mark.timeout(300)
def test_the_sweep_adds_env_counts_and_caps_torchrl_but_never_the_main_count():
    cfg = {"num_envs": 128, "sweep_envs": [8, 64, 128, 256], "torchrl_max_envs": 64,
           "sweep_contenders": ["gym_sync", "torchrl_auto"]}
    plan, notes = trial_plan(cfg, ["ours:process/slots/process/auto", "gym_sync", "torchrl_auto"])
    assert plan[:3] == [("ours:process/slots/process/auto", 128), ("gym_sync", 128), ("torchrl_auto", 128)]
    assert plan[3:] == [("gym_sync", 8), ("torchrl_auto", 8), ("gym_sync", 64), ("torchrl_auto", 64),
                        ("gym_sync", 256)]
    assert notes == ["torchrl contenders skipped at [256] envs (torchrl_max_envs=64: one process per env)"]


def test_a_small_benchmark_alternates_contenders_and_reports_ratios(tmp_path):
    cfg = {"workload": WORKLOAD, "num_envs": 4, "repeats": 2, "warmup": 0.2, "seconds": 0.5,
           # the layout ours:auto picks by measurement, beside both loops (a fixed layout: test_ray.py's benchmark)
           "contenders": ["gym_sync", "bare_procs", "ours:auto"],
           "sweep_envs": [2], "sweep_contenders": ["gym_sync"], "trial_timeout": 120}
    lines: list[str] = []
    report = run_bench(cfg, tmp_path, log=lines.append)
    order = [t["contender"] for t in report["trials"] if t["num_envs"] == 4]
    n = len(cfg["contenders"])
    assert order[:n] == cfg["contenders"] and order[n:] == cfg["contenders"][::-1], "alternating, reversed"
    for name in cfg["contenders"]:
        entry = report["summary"][name]["4"]
        assert entry["ok"] == 2 and entry["median"] > 0, (name, entry)
    assert report["limit"]["ok"] and report["limit"]["fps"] > 0
    assert report["summary"]["gym_sync"]["2"]["median"] > 0
    # ours:auto is set against what its own trials predicted (each probed before it ran), not a re-prediction
    own = [t["predicted_fps"] for t in report["trials"] if t["contender"] == "ours:auto" and t["num_envs"] == 4]
    assert len(own) == 2 and report["summary"]["ours:auto"]["4"]["predicted"] == pytest.approx(statistics.median(own))
    saved = json.loads((tmp_path / "bench_cartpole.json").read_text())
    assert saved["summary"].keys() == report["summary"].keys()
    table = format_report(report)
    assert "x gym_sync" in table and "x bare_procs" in table and "% of limit" in table and "machine limit" in table
    assert "frames/s (median) by env count:" in table and "| 2 | " in table  # the sweep's table
    _each_command_plans_the_graph_its_trial_measured(report, table)


def _each_command_plans_the_graph_its_trial_measured(report: dict, table: str) -> None:
    """The printed command of every ours:* trial, planned again from its text, gives the graph the trial built."""
    import shlex
    from dataclasses import asdict

    from pipeline.plan.layout import Costs
    from pipeline.plan import resolve_plan

    ours = [t for t in report["trials"] if t["contender"].startswith("ours:")]
    assert ours
    for trial in ours:
        words = shlex.split(trial["command"])
        assert words[:3] == ["python", "-m", "pipeline"]
        assert f"env.num_envs={trial['num_envs']}" in words
        assert f"  {trial['contender']}: " in table or trial["num_envs"] != report["num_envs"]
        if trial["contender"] in ("ours:auto", "ours:train"):  # the choice depends on the probe: plan it from its costs
            cfg, planned, machine = plan_for(words[3:])
            again = resolve_plan(cfg, machine, planned.env_spec, Costs.from_dict(trial["costs"])).graph
        else:
            again = plan_for(words[3:])[1].plan.graph
        assert asdict(again) == {k: (tuple(v) if isinstance(v, list) else v) for k, v in trial["graph"].items()}, \
            trial["contender"]


@pytest.mark.timeout(120)
def test_bare_procs_runs_one_loop_per_cpu_and_leaves_no_process():
    result = run_bare(WORKLOAD, 5, warmup=0.2, seconds=0.5, cpus=2)
    assert result["graph"] == {"processes": 2, "envs_per_process": [3, 2]}
    assert result["frames"] > 0 and result["seconds"] >= 0.5
    assert mp.active_children() == []


@pytest.mark.timeout(120)
def test_bare_procs_fails_when_one_of_its_processes_dies():
    workload = _faulty(at_step=30)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"bare_procs: process \d exited with code 1"):
        run_bare(workload, 4, warmup=1.0, seconds=5.0, cpus=2)
    assert time.monotonic() - start < 60
    assert mp.active_children() == []


@pytest.mark.timeout(120)
def test_bare_procs_kills_a_hung_process_and_returns():
    workload = _faulty(at_step=30, fault="hang")
    result = run_bare(workload, 2, warmup=0.2, seconds=0.5, cpus=2)
    assert result["frames"] == 0, "both hung before the timing began"
    assert mp.active_children() == []


def test_ours_auto_plans_for_collection_alone_and_its_command_spells_the_layout_out():
    # CartPole/64 at 4,096 frames a batch: a PPO run is trainer-bound on 2 CPUs, so the command's own plan (ours:train)
    # counts the trainer; ours:auto leaves it out (the bench trains nothing) and may pick another layout
    workload = {**WORKLOAD, "overrides": ["env=cartpole"], "num_envs": 64, "frames_per_batch": 4096}
    assert layout_overrides("ours:auto") == layout_overrides("ours:train") == []
    _, training, _ = plan_for(ours_overrides("ours:train", workload, 64))
    _, collecting, _ = plan_for(ours_overrides("ours:auto", workload, 64), count_trainer=False)
    assert training.costs.trainer_s > 0 and collecting.costs.trainer_s == 0
    assert collecting.plan.layout.bound != "trainer"
    words = layout_words(collecting.plan.layout)
    assert words[:3] == [f"workers={collecting.plan.layout.workers}", f"server={collecting.plan.layout.server}",
                         "transport=slots"]
    assert f"env.envs_per_worker={collecting.plan.layout.envs_per_worker}" in words
    assert mp.active_children() == []


def test_scale_sweeps_ours_auto_against_both_loops_from_8_to_1024_envs():
    cfg = apply_scale({"scale": True, "contenders": "default", "sweep_envs": [], "num_envs": 64})
    assert cfg["sweep_envs"] == SCALE_ENVS and SCALE_ENVS[0] == 8 and SCALE_ENVS[-1] == 1024
    assert cfg["contenders"] == cfg["sweep_contenders"] == ["ours:auto", "ours:train", "gym_sync", "bare_procs"]
    plan, _ = trial_plan(cfg, cfg["contenders"])
    assert ("ours:auto", 1024) in plan and ("bare_procs", 8) in plan and ("gym_sync", 512) in plan
    assert apply_scale({"scale": False, "contenders": "default"}) == {"scale": False, "contenders": "default"}
    own = apply_scale({"scale": True, "contenders": ["ours:auto"], "sweep_envs": [32, 64]})
    assert own["sweep_envs"] == [32, 64] and own["contenders"] == ["ours:auto"]


def test_the_sweep_table_has_a_row_per_env_count_with_ours_over_each_loop():
    summary = {"ours:auto": {"8": {"median": 300.0, "predicted": 250.0}, "64": {"median": 900.0}},
               "gym_sync": {"8": {"median": 100.0}, "64": {"median": 600.0}},
               "bare_procs": {"8": {"median": 400.0}, "64": {"median": 1000.0}}}
    lines = format_sweep({"summary": summary})
    assert lines[1] == ("| envs | ours:auto | gym_sync | bare_procs | ours:auto predicted | ours:auto x gym_sync "
                        "| ours:auto x bare_procs |")
    assert lines[3] == "| 8 | 300 | 100 | 400 | 250 | 3.00 | 0.75 |"
    assert lines[4] == "| 64 | 900 | 600 | 1,000 | - | 1.50 | 0.90 |"


def test_the_frames_workload_moves_raw_screens_at_almost_no_step_cost():
    from pipeline.bench.frames_env import FramesEnvFactory

    env = FramesEnvFactory(episode_steps=3)()
    obs, _ = env.reset(seed=1)
    assert obs.shape == (210, 160, 3) and obs.dtype.name == "uint8" and obs.nbytes == 100_800
    again, _ = FramesEnvFactory(episode_steps=3)().reset(seed=1)
    assert (obs == again).all()  # seeded
    for t in range(3):
        obs, reward, term, trunc, _ = env.step(t % 6)
        assert env.observation_space.contains(obs) and not term
    assert trunc  # the episode ends at episode_steps


def test_the_block_bench_times_an_env_block_and_the_hand_loop_on_the_same_steps(monkeypatch, capsys):
    from pipeline.bench import block

    runs = block.contenders("CartPole-v1", 4)
    assert set(runs) == {"block", "bare"}
    assert all(0 < runs[name](3) < 0.01 for name in runs)  # seconds per env step
    monkeypatch.setattr(block, "STEPS_PER_ROUND", 400)
    block.main(["--envs", "2", "5", "--rounds", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["2", "5"]
    assert all(float(row.split("|")[5]) > 0 for row in rows)


def test_the_worker_loop_bench_reads_the_cpu_of_our_workers_and_driver_and_the_hand_loop_and_stops(capsys):
    import threading

    from pipeline.bench import worker_loop
    from tests.procs import spawned_children

    assert worker_loop.process_cpu_s(os.getpid()) > 0
    before, children = set(threading.enumerate()), set(spawned_children(os.getpid()))
    got = worker_loop.measure(8, rounds=1, seconds=0.5)
    assert set(got) == {"ours_worker", "ours_driver", "hand"}
    assert all(0 < got[k] < 0.01 for k in ("ours_worker", "hand")) and 0 <= got["ours_driver"] < 0.01  # s per frame
    worker_loop.main(["--envs", "4", "--rounds", "1", "--seconds", "0.3"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["4"] and float(rows[0].split("|")[5]) > 0
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before, "the collector's threads outlived the bench"
    while set(spawned_children(os.getpid())) - children and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(spawned_children(os.getpid())) - children, "worker processes outlived the bench"


def test_a_loop_policy_carries_each_rows_recurrent_state_and_restarts_it_where_an_episode_ended():
    import numpy as np
    import torch

    from components.envs import EnvSpec
    from components.inference.serving import serving_engine
    from components.recurrent import RecurrentActorCritic, zero_state
    from pipeline.bench.workload import LoopPolicy

    torch.manual_seed(0)
    model = RecurrentActorCritic(EnvSpec((3,), "float32", "discrete", action_n=2), hidden=(8,), rnn="lstm",
                                 rnn_hidden=4).eval()
    policy = LoopPolicy(serving_engine(model, "auto", "cpu", seed=0), rows=2)
    modes = np.full(2, 2, np.int8)  # deterministic
    obs = np.random.default_rng(0).standard_normal((3, 2, 3)).astype(np.float32)
    state = zero_state(model, 2)
    for t in range(3):
        policy(obs[t], modes)
        with torch.no_grad():
            out = model.act({"observation": torch.from_numpy(obs[t]), **state}, torch.from_numpy(modes))
        state = {k: out[f"next.{k}"] for k in state}
        for key in state:
            assert np.allclose(policy.state[key], state[key].numpy(), atol=1e-6)
    policy.ended(np.array([True, False]))
    assert all(not v[0].any() and v[1].any() for v in policy.state.values())
    assert policy.is_first.tolist() == [True, False]


@pytest.mark.timeout(240)
def test_recurrent_variants_of_ours_and_the_loops_run_the_same_workload_with_an_lstm(tmp_path):
    cfg = {"workload": WORKLOAD, "num_envs": 4, "repeats": 1, "warmup": 0.2, "seconds": 0.5,
           "contenders": ["ours:process/slots/process/auto+lstm16", "bare_procs+lstm16", "gym_sync+lstm16"],
           "sweep_envs": [], "sweep_contenders": [], "trial_timeout": 120}
    report = run_bench(cfg, tmp_path, log=lambda line: None)
    for name in cfg["contenders"]:
        assert report["summary"][name]["4"]["ok"] == 1 and report["summary"][name]["4"]["median"] > 0, name
    ours = next(t for t in report["trials"] if t["contender"].startswith("ours:"))
    assert "model.rnn=lstm" in ours["command"] and "model.rnn_hidden=16" in ours["command"]
    assert ours.get("predicted_fps") is None  # the limit's costs were probed with the feed-forward model
