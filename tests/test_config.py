"""Config tree: every option composes, bad values are one-line errors, auto is explained."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.plan import Machine, resolve_plan
from pipeline.validate import ConfigError, validate
from tests.conftest import CONF_DIR, ROOT, compose

CPU_MACHINE = Machine(cpus=2, cuda=False)
GPU_MACHINE = Machine(cpus=8, cuda=True, cuda_count=1)

OPTIONS = sorted(
    (group.name, option.stem)
    for group in CONF_DIR.iterdir() if group.is_dir() and group.name not in ("experiment", "bench_workload", "specialize")
    for option in group.glob("*.yaml")
)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_of_every_group_composes_and_validates(group, option):
    overrides = [f"{group}={option}"]
    if group == "transport" and option == "slots":
        overrides.append("workers=process")
    if group == "replay" and option != "none":
        overrides.append("trainer=dqn")
    if group == "trainer" and option.startswith("dqn"):
        overrides.append("replay=uniform")
    cfg = compose(*overrides)
    if group == "device" and option == "cuda":
        with pytest.raises(ConfigError, match="CUDA is not available"):
            validate(cfg, cuda_available=False)
        validate(cfg, cuda_available=True, cuda_count=1)
        return
    validate(cfg, cuda_available=False)
    plan = resolve_plan(cfg, CPU_MACHINE)
    assert plan.lines()


@pytest.mark.parametrize("workload", ["cartpole", "pong"])
def test_every_bench_workload_composes(workload):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("bench", overrides=[f"bench_workload={workload}"])
    assert cfg.num_envs == cfg.bench_workload.num_envs and cfg.repeats >= 1


def test_trainer_env_specialisations_apply_to_their_pair_only():
    assert compose("env=atari").trainer.lr == pytest.approx(2.5e-4)
    assert compose("env=atari", "trainer.lr=0.01").trainer.lr == pytest.approx(0.01), "the command line wins"
    assert compose("env=atari", "trainer=dqn", "replay=uniform").trainer.learning_starts == 80000
    assert compose("trainer=dqn", "replay=uniform").trainer.learning_starts == 1000
    assert compose().trainer.lr == pytest.approx(1e-3)


def test_dqn_swaps_in_a_q_network_for_any_encoder():
    cfg = compose("trainer=dqn", "replay=uniform")
    assert (cfg.model._target_, cfg.model.encoder, list(cfg.model.hidden)) == ("components.models.QNetwork", "mlp", [256, 256])
    cfg = compose("env=atari", "trainer=dqn", "replay=uniform", "replay.storage=disk")
    assert (cfg.model._target_, cfg.model.encoder) == ("components.models.QNetwork", "nature_cnn")
    plan = resolve_plan(cfg, CPU_MACHINE)
    assert "memory-mapped files in the run directory" in plan.reason("replay")


def test_atari_env_picks_its_parts_but_the_command_line_wins():
    cfg = compose("env=atari")
    assert (cfg.model.encoder, cfg.workers.backend, cfg.trainer.frames_per_batch) == ("nature_cnn", "process", 2048)
    cfg = compose("env=atari", "workers=thread", "model=mlp")
    assert (cfg.model.encoder, cfg.workers.backend) == ("mlp", "thread")


BAD = [
    (["server.max_batch_size=0"], "server.max_batch_size=0: must be >= 1"),
    (["server.min_batch_size=300"], "server.min_batch_size=300: must be <= server.max_batch_size=256"),
    (["trainer.total_frames=-5"], "trainer.total_frames=-5: must be >= 1"),
    (["env.id=NoSuchEnv-v0"], "env.id='NoSuchEnv-v0': 'NoSuchEnv-v0' is not a registered gymnasium environment"),
    (["env.id=CartPol-v1"], "did you mean CartPole-v1"),
    (["device=cuda"], "device.policy_device='cuda': CUDA is not available"),
    (["transport=slots"], "transport.kind='slots': needs workers=process"),
    (["server.backend=gpu"], "server.backend='gpu': must be one of thread, process"),
    (["chunking=fixed", "chunking.size=0"], "chunking.size=0: must be >= 1"),
    (["trainer.gamma=1.5"], "trainer.gamma=1.5: must be in (0, 1]"),
    (["workers.affinity=[[0]]"], "workers.affinity=[[0]]: only applies to workers=process"),
    (["trainer=dqn"], "replay.kind='none': trainer=dqn needs a replay buffer"),
    (["replay=uniform"], "replay.kind='uniform': trainer=ppo learns on-policy, use replay=none"),
    (["trainer=dqn", "replay=prioritized", "replay.beta=2"], "replay.beta=2.0: must be in [0, 1]"),
    (["trainer=dqn", "replay=uniform", "replay.storage=tape"], "replay.storage='tape': must be one of memory, disk"),
    (["trainer=dqn", "replay=uniform", "trainer.tau=0"], "trainer.tau=0.0: must be in (0, 1]"),
    (["device.env_device=cuda"], "device.env_device='cuda': CUDA is not available"),
    (["server.static_batch_size=64"], "server.static_batch_size=64: CUDA graphs need device.policy_device=cuda"),
    (["workers=process", "transport=slots", "device.policy_device=mps"],
     "device.policy_device='mps': transport=slots needs a cpu or cuda policy"),
    (["trainer=dqn", "replay=uniform", "replay.storage=disk", "device.storing_device=mps"],
     "device.storing_device='mps': replay.storage=disk keeps transitions in memory-mapped host files"),
    (["server.engine=jax"], "server.engine='jax': must be one of auto, torch, numpy"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_values_are_rejected_with_the_key_the_value_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(*overrides), cuda_available=False)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def _run_dir(args: list[str], tmp_path: Path) -> Path:
    return tmp_path / "_".join(a.replace("=", "-").replace("[", "").replace("]", "") for a in args)


def _cli(args: list[str], tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline", *args, f"hydra.run.dir={_run_dir(args, tmp_path)}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_a_user_sees_one_line_exit_code_2_and_no_traceback(tmp_path):
    cases = [["server.max_batch_size=0"], ["env.id=NoSuchEnv-v0"], ["device=cuda"], ["workers=thread", "transport=slots"],
             ["env=gym", "env.id=Pendulum-v1", "trainer=dqn", "replay=uniform"]]
    procs = [(_cli(args, tmp_path), args) for args in cases]  # run side by side
    for proc, args in procs:
        out, err = proc.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == 2, (args, err)
        assert len(lines) == 1 and lines[0].startswith("config error: "), (args, err)
        assert "Traceback" not in out + err
        assert not (_run_dir(args, tmp_path) / "metrics.jsonl").exists(), "nothing starts on a bad config"


def test_hydra_reports_its_own_errors(tmp_path):
    proc = _cli(["workers=banana"], tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "workers/banana" in err
    proc = _cli(["server.max_batch_sise=4"], tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "max_batch_sise" in err


# ------------------------------------------------------------------ auto plan
def test_envs_per_worker_auto_leaves_a_cpu_for_the_inference_server():
    plan = resolve_plan(compose("env=atari"), Machine(cpus=2, cuda=False))
    assert (plan.graph.num_workers, plan.graph.envs_per_worker, plan.graph.splits) == (1, 16, 2)
    assert "1 worker process(es) on 2 CPUs" in plan.reason("workers")
    plan = resolve_plan(compose("env=atari"), Machine(cpus=8, cuda=False))
    assert (plan.graph.num_workers, plan.graph.envs_per_worker) == (6, 3)
    plan = resolve_plan(compose(), CPU_MACHINE)
    assert (plan.graph.num_workers, plan.graph.envs_per_worker) == (1, 8)
    plan = resolve_plan(compose("workers=process", "env.envs_per_worker=2"), CPU_MACHINE)
    assert plan.graph.num_workers == 4


def test_transport_auto_with_thread_workers_relays_through_the_driver():
    plan = resolve_plan(compose(), CPU_MACHINE)
    assert (plan.graph.workers, plan.graph.transport, plan.graph.server) == ("thread", "driver", "thread")
    assert "auto -> driver: env workers are threads" in plan.reason("transport")
    assert plan.graph.chunk_len == 1 and "thread workers" in plan.reason("chunking")


def test_transport_auto_with_process_workers_uses_slots_and_a_process_server():
    plan = resolve_plan(compose("workers=process"), CPU_MACHINE)
    assert (plan.graph.transport, plan.graph.server) == ("slots", "process")
    assert "server=thread -> process" in plan.reason("transport")
    plan = resolve_plan(compose("workers=process", "server=process"), CPU_MACHINE)
    assert "server=thread" not in plan.reason("transport")


COMBINATIONS = [
    # workers, transport, server -> resolved transport, server, phrase in the reason
    ("thread", "auto", "thread", "driver", "thread", "env workers are threads"),
    ("thread", "auto", "process", "driver", "process", "env workers are threads"),
    ("thread", "driver", "thread", "driver", "thread", "driver"),
    ("thread", "driver", "process", "driver", "process", "driver"),
    ("process", "auto", "thread", "slots", "process", "server=thread -> process"),
    ("process", "auto", "process", "slots", "process", "reach the inference process through shared slots"),
    ("process", "driver", "thread", "driver", "thread", "driver"),
    ("process", "driver", "process", "driver", "process", "driver"),
    ("process", "slots", "thread", "slots", "thread", "slots"),
    ("process", "slots", "process", "slots", "process", "slots"),
]


@pytest.mark.parametrize(("workers", "transport", "server", "want_transport", "want_server", "phrase"), COMBINATIONS)
def test_every_combination_resolves_with_a_reason(workers, transport, server, want_transport, want_server, phrase):
    cfg = compose(f"workers={workers}", f"transport={transport}", f"server={server}")
    validate(cfg, cuda_available=False)
    plan = resolve_plan(cfg, CPU_MACHINE)
    assert (plan.graph.transport, plan.graph.server) == (want_transport, want_server)
    assert phrase in plan.reason("transport")
    assert str(plan).startswith("plan:")


def test_auto_falls_back_to_the_driver_when_the_policy_device_cannot_be_shared():
    cfg = compose("workers=process", "device.policy_device=mps")
    plan = resolve_plan(cfg, CPU_MACHINE)
    assert plan.graph.transport == "driver" and "cannot share weights" in plan.reason("transport")


def test_explicit_choices_are_kept():
    plan = resolve_plan(compose("workers=process", "transport=slots", "server=thread"), CPU_MACHINE)
    assert (plan.graph.transport, plan.graph.server) == ("slots", "thread")
    plan = resolve_plan(compose("workers=process", "transport=driver", "server=process"), CPU_MACHINE)
    assert (plan.graph.transport, plan.graph.server) == ("driver", "process")


def test_a_block_larger_than_max_batch_size_is_served_in_slices():
    plan = resolve_plan(compose("server.max_batch_size=3"), CPU_MACHINE)
    assert "served in 3 passes" in plan.reason("server")


def test_device_auto_says_what_it_found():
    cfg = compose("device=auto")
    assert resolve_plan(cfg, CPU_MACHINE).server.device == "cpu"
    assert "no CUDA device" in resolve_plan(cfg, CPU_MACHINE).reason("server")
    gpu = resolve_plan(cfg, GPU_MACHINE)
    assert gpu.server.device == "cuda" and gpu.trainer_device == "cuda"


@pytest.mark.parametrize(("overrides", "chunk_len"), [
    (["workers=process", "env.num_envs=8", "env.envs_per_worker=4", "trainer.frames_per_batch=256"], 32),
    (["workers=process", "env.num_envs=64", "env.envs_per_worker=32", "trainer.frames_per_batch=1024"], 16),
    (["workers=process", "env.num_envs=2", "env.envs_per_worker=1", "trainer.frames_per_batch=16"], 16),
    (["workers=process", "env.num_envs=4", "env.envs_per_worker=4", "trainer.frames_per_batch=8"], 2),
    (["workers=process", "chunking=step"], 1),
    (["chunking=fixed", "chunking.size=7"], 7),
])
def test_chunking_auto_follows_its_rule(overrides, chunk_len):
    plan = resolve_plan(compose(*overrides), CPU_MACHINE)
    assert plan.graph.chunk_len == chunk_len
