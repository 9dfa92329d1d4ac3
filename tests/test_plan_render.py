"""The plan's sentences, written by pipeline.plan.render from the choices' codes and facts.

Decisions are tested by code in test_config.py and test_layout.py; this file
holds the English, once per sentence, and checks that every choice the
resolver and the Ray plan can make has a sentence.
"""

from __future__ import annotations

import pytest

from pipeline.plan import Choice, Machine, resolve_plan, render
from pipeline.plan.ray import ray_plan
from tests.conftest import compose

CPU = Machine(cpus=2, cuda=False)
GPU = Machine(cpus=4, cuda=True, cuda_count=1)


class _Cluster:
    def total_cpus(self) -> float:
        return 4.0

    def describe(self) -> str:
        return "local cluster, 4 CPUs"


CONFIGS = [
    [], ["workers=process"], ["workers=process", "server=thread"], ["workers=process", "server=inline", "workers.splits=2"],
    ["workers=thread", "server=inline", "device.policy_device=cuda"], ["env=atari", "trainer=dqn", "replay=uniform"],
    ["replay=uniform", "replay.storage=disk"], ["workers=process", "chunking=fixed", "chunking.size=7"],
    ["workers=process", "chunking=step"], ["workers.concurrent_envs=true", "workers.splits=3"],
    ["workers=process", "env.num_envs=64", "server.max_batch_size=16"], ["device=cuda"],
    ["collector.stall_timeout=null", "collector.reset_at_each_iter=true", "collector.driver_affinity=[0]"],
    ["env.envs_per_worker=3", "workers=process", "env.num_envs=8"], ["trainer.target_return=null"],
    ["workers=process", "device.policy_device=mps"],
]
RAY_CONFIGS = [["workers=ray"], ["workers=ray", "ray.num_actors=2", "chunking=fixed", "chunking.size=5"],
               ["workers=ray", "chunking=step"]]


@pytest.mark.parametrize("overrides", CONFIGS + RAY_CONFIGS, ids=lambda o: " ".join(o) or "default")
def test_every_choice_the_plan_makes_has_a_sentence(overrides):
    cfg = compose(*overrides)
    for machine in (CPU, GPU):
        plan = resolve_plan(cfg, machine)
        if "workers=ray" in overrides:
            plan, _ = ray_plan(cfg, plan, _Cluster())
        lines = plan.lines()
        assert len(lines) == len(plan.choices) + 1
        assert all(line.split(maxsplit=1)[1:] for line in lines), lines
        for key, choice in plan.choices:
            assert isinstance(choice, Choice) and plan.reason(key) == render.line(key, choice)


def test_the_sentences_of_the_default_plan():
    plan = resolve_plan(compose(), CPU)
    assert plan.lines()[0] == "envs      8 in 1 thread worker(s) of up to 8"
    assert plan.reason("workers") == ("auto -> one thread worker steps all 8 envs (threads share the GIL); "
                                      "1 block(s) per worker")
    assert plan.reason("transport") == "auto -> slots: every worker reaches the server's shared-memory slots directly"
    assert plan.reason("chunking") == "auto -> 1 step per message: thread workers have no process boundary to amortise"
    assert plan.reason("server").startswith("thread: policy on cpu in a driver thread, batches of ")
    assert plan.reason("server").endswith("; engine auto -> numpy: a small MLP on the CPU (numpy serves a 64-row "
                                          "CartPole batch in ~54 us, torch in ~149 us)")
    assert plan.reason("device") == "policy cpu, trainer cpu, batches stored on cpu"
    assert str(plan).splitlines()[0] == "plan:"


@pytest.mark.parametrize(("choice", "sentence"), [
    (Choice("cuda", "auto.cuda"), "auto -> cuda: a CUDA device is available"),
    (Choice("cpu", "auto.no_cuda"), "auto -> cpu: no CUDA device on this machine"),
    (Choice("cpu", "inline.cpu", {"asked": Choice("cuda", "auto.cuda")}),
     "server=inline -> cpu: each worker runs its copy of the policy on its CPU (auto -> cuda: a CUDA device is available)"),
    (Choice("cuda:1", "given"), "cuda:1"),
])
def test_device_sentences(choice, sentence):
    assert render.device(choice) == sentence


def test_chunking_and_worker_sentences():
    from pipeline.plan import rules

    assert render.chunking(rules.chunk_len(64, 1024, 32)) == (
        "auto -> 4 steps x 32 envs per message: at least 64 transitions, a quarter of frames_per_batch // num_envs "
        "(4 steps) when larger, never above a batch")
    assert render.chunking(rules.chunk_len(9, 1024, 4, 5)).startswith("auto -> 28 steps x 4-5 envs per message")
    assert render.chunking(Choice(1, "step", {"unit": "chunk"})) == "step: every step is a chunk (a round trip per step: slow)"
    assert render.chunking(Choice(7, "fixed")) == "fixed: 7 steps per message"
    assert render.envs_per_worker(rules.envs_per_worker(None, 16, "process", 2)) == (
        "auto -> 16 envs per worker: 1 worker process(es) on 2 CPUs, one CPU left for inference")
    assert render.envs_per_worker(rules.envs_per_worker(None, 16, "process", 2, "inline")) == (
        "auto -> 8 envs per worker: 2 worker process(es) on 2 CPUs, each with its own policy (server=inline)")
    assert render.envs_per_worker(rules.envs_per_worker(4, 16, "process", 2)) == "process workers of 4 envs"
    plan = resolve_plan(compose("workers=process", "server=inline", "workers.splits=2"), CPU)
    assert plan.reason("workers").endswith("; 1 block per worker (inline answers within the call: nothing to overlap)")
    plan = resolve_plan(compose("workers=process", "transport=slots", "workers.concurrent_envs=true"), CPU)
    assert plan.reason("workers").endswith("each env in its own thread, served as it returns (none waits for another's "
                                           "step); workers.splits=2 -> 1 (no blocks to alternate)")


def test_server_replay_and_sweep_share_sentences():
    from components.envs import EnvSpec

    plan = resolve_plan(compose("server.max_batch_size=3"), CPU)
    assert "a 8-env block exceeds max_batch_size, so it is served in 3 passes" in plan.reason("server")
    frames = EnvSpec((4, 84, 84), "uint8", "discrete", action_n=6)
    plan = resolve_plan(compose("env=atari", "trainer=dqn", "replay=uniform", "replay.storage=disk"), CPU, frames)
    assert "transitions in memory-mapped files in the run directory, frame dedup auto -> on: 4x84x84 uint8 frame " \
           "stacks, each frame stored once" in plan.reason("replay")
    shared = Machine(cpus=1, cuda=False, total_cpus=2, sweep_jobs=2)
    plan = resolve_plan(compose(), shared)
    assert plan.reason("cpus") == "sized for 1 of 2 CPU(s): 2 sweep jobs run at once (hydra.launcher.n_jobs)"
    assert [key for key, _ in plan.choices][:3] == ["workers", "cpus", "transport"]


def test_the_ray_plan_says_hosts_object_refs_and_no_chunking_line():
    cfg = compose("workers=ray", "ray.num_actors=2", "chunking=fixed", "chunking.size=5")
    plan, spec = ray_plan(cfg, resolve_plan(cfg, CPU), _Cluster())
    keys = [key for key, _ in plan.choices]
    assert keys[0] == "cluster" and "chunking" not in keys
    assert plan.lines()[0] == f"envs      {spec.num_envs} in 2 ray env host(s) of {spec.num_envs // 2}"
    assert plan.reason("transport").startswith("Ray object refs: fixed: 5 steps per chunk (")
    assert plan.reason("workers").startswith("ray: 2 env host(s) (Ray actors of ")
    assert "in every env host (its own copy)" in plan.reason("server")
    auto = ray_plan(compose("workers=ray"), resolve_plan(compose("workers=ray"), CPU), _Cluster())[0]
    assert auto.choice("workers").facts["hosts"].code == "auto.per_cpu"
    assert "auto -> 4: one per 1 CPU(s) of the cluster's 4, at most num_envs" in auto.reason("workers")


@pytest.mark.parametrize(("mask", "trainer", "sentence"), [
    ("obs", "ppo", "masks     the observation's 'action_mask' leaf (env.action_mask_key): actions are drawn and "
                   "taken greedily among the allowed ones; masked log-probs and entropy in PPO"),
    ("info", "dqn", "masks     info['action_mask'] of every reset and step, moved into the observation "
                    "(env.action_mask_key): actions are drawn and taken greedily among the allowed ones; masked max "
                    "in its targets"),
])
def test_the_plan_says_where_the_action_mask_comes_from(mask, trainer, sentence):
    from components.action_masks import with_masks
    from components.envs import probe_env_spec
    from tests.fakes import TreeEnvFactory

    spec = probe_env_spec(with_masks(TreeEnvFactory(mask=mask), "action_mask"))
    assert (spec.action_mask, spec.action_mask_source) == ("action_mask", mask)
    overrides = ["trainer=dqn", "replay=uniform"] if trainer == "dqn" else []
    lines = resolve_plan(compose(*overrides), CPU, env_spec=spec).lines()
    assert sentence in lines, lines
    assert not [line for line in resolve_plan(compose(), CPU).lines() if line.startswith("masks")]
