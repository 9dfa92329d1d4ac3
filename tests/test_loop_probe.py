"""The plan's loop probe runs the real worker loop, for every kind of run, and leaves nothing behind."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

from components.collector import worker
from components.inference.serving import serving_engine
from pipeline.plan import probes
from pipeline.plan.inputs import build_env
from pipeline.plan.loop_probe import time_worker_loop
from pipeline.plan.model_spec import model_spec_for
from tests.conftest import compose

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


@pytest.fixture(autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


KINDS = [
    ((), "numpy"),  # CartPole, the built-in MLP on the numpy engine
    (("model.rnn=lstm",), "torch"),  # a recurrent policy: state leaves in the response
    (("env=classic", "env.id=Pendulum-v1"), "numpy"),  # Box actions
    (("env=gym", "env.id=Blackjack-v1"), "torch"),  # a Tuple of Discrete observations
    (("env.factory._target_=byo_example.PickEnvFactory", "~env.factory.id", "model._target_=byo_example.SlotPolicy",
      "+model.width=16"), "torch"),  # a Dict observation with an action mask, a model of the user's own
]


@pytest.mark.parametrize("overrides,engine", KINDS, ids=["cartpole", "lstm", "box-actions", "tuple-obs", "dict-own"])
def test_the_real_worker_loop_is_timed_for_every_kind_of_run(monkeypatch, overrides, engine):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg = compose(*overrides)
    _, spec = build_env(cfg)
    served = serving_engine(model_spec_for(cfg).build(spec).eval(), engine, "cpu", "cpu", seed=0,
                            obs_leaves=spec.obs_leaves)
    turns: list[int] = []
    real_loop = worker._loop

    def counted_loop(index, blocks, channels, chunks, control, mode, keys):  # noqa: ANN001, ANN202
        try:
            return real_loop(index, blocks, channels, chunks, control, mode, keys)
        finally:
            turns.append(int(control.timing[index][3]))

    monkeypatch.setattr(worker, "_loop", counted_loop)
    step, per_env = time_worker_loop(spec, served, 0.04)
    assert len(turns) == 2 and min(turns) > 0, f"the loop ran for each block size and took steps: {turns}"
    assert step > 0 and per_env >= 0
    assert not [t for t in threading.enumerate() if t.name.startswith("loop-probe")], "its threads are gone"


def test_the_plan_probes_the_real_loop_and_falls_back_to_the_block_step_with_a_warning(monkeypatch):
    from components.envs import GymEnvFactory, probe_env_spec
    from components.models import ActorCritic

    factory = GymEnvFactory("CartPole-v1")
    spec = probe_env_spec(factory)
    engine = serving_engine(ActorCritic(spec, hidden=(16,)), "numpy", "cpu", seed=0)
    called = []
    monkeypatch.setattr(probes, "time_worker_loop", lambda *a: called.append(a) or (20e-6, 1e-6))
    costs = probes.measure(factory, engine, spec, 2, budget_s=0.1, hop_s=1e-4)
    assert called and (costs.loop_step_s, costs.loop_env_s) == (20e-6, 1e-6)

    def broken(*args):  # noqa: ANN002, ANN202
        raise RuntimeError("no answer")

    monkeypatch.setattr(probes, "time_worker_loop", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        costs = probes.measure(factory, engine, spec, 2, budget_s=0.1, hop_s=1e-4)
    assert costs.loop_step_s > 0, "the block step alone was timed"
    assert any("worker-loop probe failed (RuntimeError: no answer)" in str(w.message) for w in caught)


@pytest.mark.parametrize("overrides", [("env=gym", "env.id=Blackjack-v1"),
                                       ("env.factory._target_=tests.fakes.TreeEnvFactory", "~env.factory.id")],
                         ids=["tuple", "dict"])
def test_a_dict_or_tuple_env_gets_a_measured_layout(overrides):
    """The null env answers in the space's own structure. A packed row broke a Dict/Tuple env's spec in the loop
    probe, and the layout probe failed, silently, for every such env: the plan fell back to its rule."""
    from pipeline.plan import Machine
    from pipeline.plan.inputs import plan_config

    planned = plan_config(compose(*overrides), Machine(cpus=2, cuda=False))
    assert planned.costs is not None and planned.plan.layout is not None, "transport=auto measured its layout"
    assert planned.costs.loop_step_s > 0


@pytest.mark.parametrize("error", [ValueError("bad row"), KeyError("observation"), TypeError("not a tensor")],
                         ids=["value", "key", "type"])
def test_a_probe_bug_is_printed_when_the_model_was_already_built(monkeypatch, capsys, error):
    """A ValueError/KeyError/TypeError from the probe of a run whose model the plan built already is a probe bug,
    not a model the env cannot have: the plan says it fell back to its rule (it hid the Dict/Tuple bug before)."""
    from pipeline.plan import Machine
    from pipeline.plan.inputs import plan_config

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise error

    monkeypatch.setattr(probes, "probe_for_config", broken)
    planned = plan_config(compose(), Machine(cpus=2, cuda=False))
    assert planned.costs is None and planned.plan.layout is None
    err = capsys.readouterr().err
    assert f"the layout probe failed ({type(error).__name__}" in err and "falls back to its rule" in err


@pytest.mark.parametrize("kind", ["null", "cartpole"])
@pytest.mark.parametrize("loop", ["ours", "hand"])
def test_the_instruction_count_runs_each_loop_for_exactly_the_steps_asked(loop, kind):
    """The valgrind benchmark subtracts two runs of K and 3K steps: each must take exactly as many steps as asked
    (ours stops at its K-th request, which follows its (K-1)-th step: the same one short in both runs)."""
    from pipeline.bench.loop_instructions import run_steps

    short, long = run_steps(loop, kind, 4, 70), run_steps(loop, kind, 4, 210)
    assert long - short == 140, (short, long)
    assert short in (69, 70)


def test_the_instruction_count_without_valgrind_is_one_line_and_a_failure(monkeypatch, capsys):
    from pipeline.bench import loop_instructions

    monkeypatch.setattr(loop_instructions.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as ended:
        loop_instructions.main(["--envs", "2"])
    assert "valgrind is not installed" in str(ended.value.code)
    assert capsys.readouterr().out == ""


def test_the_time_comparison_runs_each_loop_for_exactly_the_steps_asked_with_the_real_engine():
    from pipeline.bench.loop_time import compare, policy_engine, time_ours

    engine = policy_engine()
    _, taken = time_ours(engine, 3, 40)
    assert taken == 40
    out = compare(2, rounds=1, steps=30, engine=engine)
    assert set(out) == {"ours_us", "hand_us", "ratio", "low", "high"}
    assert out["ours_us"] > 0 and out["hand_us"] > 0 and out["low"] <= out["ratio"] <= out["high"]
