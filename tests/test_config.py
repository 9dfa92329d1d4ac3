"""Config tree: every option composes, bad values are one-line errors, auto is explained."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.bench.__main__ import BENCH_CONF_DIR
from pipeline.plan import Machine, resolve_plan
from pipeline.plan.validate import ConfigError, validate
from tests.conftest import CONF_DIR, ROOT, compose

CPU_MACHINE = Machine(cpus=2, cuda=False)
GPU_MACHINE = Machine(cpus=8, cuda=True, cuda_count=1)

OPTIONS = sorted(
    (group.name, option.stem)
    for group in CONF_DIR.iterdir() if group.is_dir() and group.name not in ("experiment", "bench", "specialize")
    for option in group.glob("*.yaml")
)


def option_overrides(group: str, option: str) -> list[str]:
    """``group=option`` plus the overrides that option needs to form a valid run."""
    overrides = [f"{group}={option}"]
    if group == "transport" and option == "slots":
        overrides.append("workers=process")
    if group == "replay" and option != "none":
        overrides.append("trainer=dqn")
    if group == "trainer" and option.startswith("dqn"):
        overrides.append("replay=uniform")
    if group == "trainer" and option == "sac":
        overrides += ["env=box2d", "env.id=BipedalWalker-v3"]  # continuous actions, no sac preset over its values
    return overrides


def option_values(group: str, option: str) -> tuple[bool, dict]:
    """The values ``conf/<group>/<option>.yaml`` sets itself (no ``defaults``), and whether it is ``_global_``."""
    path = CONF_DIR / group / f"{option}.yaml"
    is_global = any(line.strip() == "# @package _global_" for line in path.read_text().splitlines()[:3])
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(values, dict)
    values.pop("defaults", None)
    return is_global, values


def assert_values_reached(composed: DictConfig, expected: dict, where: str) -> None:
    """Every key ``expected`` sets has that value in ``composed`` (interpolations compared unresolved)."""
    actual = OmegaConf.to_container(composed, resolve=False)
    assert isinstance(actual, dict)

    def walk(want: object, got: object, path: str) -> None:
        if isinstance(want, dict):
            assert isinstance(got, dict), f"{path}: {got!r} is not a mapping"
            for key, value in want.items():
                assert key in got, f"{path}.{key} is set by the option file but missing from the composed config"
                walk(value, got[key], f"{path}.{key}")
        else:
            assert got == want, f"{path}={got!r} but the option file sets {want!r}"

    walk(expected, actual, where)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_of_every_group_composes_and_validates(group, option):
    cfg = compose(*option_overrides(group, option))
    is_global, values = option_values(group, option)
    if not values:  # only the group's default may be the schema's defaults and nothing else (collector=default)
        from pipeline.plan.inputs import compose as compose_with

        chosen = compose_with([], with_hydra=True).hydra.runtime.choices
        assert chosen.get(group) == option, f"conf/{group}/{option}.yaml sets nothing and is not the default"
        return
    if is_global:  # e.g. conf/trainer/dqn.yaml: its keys sit under trainer: (and model:)
        assert group in values, f"conf/{group}/{option}.yaml is _global_ but sets nothing under {group}:"
        assert_values_reached(cfg, values, "cfg")
    else:
        assert_values_reached(cfg[group], values, group)
    if group == "device" and option == "cuda":
        with pytest.raises(ConfigError, match="CUDA is not available"):
            validate(cfg, cuda_available=False)
        validate(cfg, cuda_available=True, cuda_count=1)
        return
    validate(cfg, cuda_available=False)
    resolve_plan(cfg, CPU_MACHINE)  # resolves without an error


def test_an_option_value_that_does_not_reach_the_config_is_caught():
    """The check above can fail: a value overridden away from the option file's is reported."""
    cfg = compose("workers=process", "workers.splits=7")
    _, values = option_values("workers", "process")
    with pytest.raises(AssertionError, match="workers.splits=7 but the option file sets 2"):
        assert_values_reached(cfg.workers, values, "workers")


BENCH_WORKLOADS = {
    # workload: env factory, encoder
    "cartpole": ("components.envs.GymEnvFactory", "mlp"),
    "pong": ("components.envs.AtariEnvFactory", "nature_cnn"),
    "frames": ("pipeline.bench.frames_env.FramesEnvFactory", "mlp"),
    "waiting": ("pipeline.bench.waiting_env.WaitingEnvFactory", "mlp"),
}


@pytest.mark.parametrize("workload", sorted(BENCH_WORKLOADS))
def test_every_bench_workload_is_the_runners_config_of_its_overrides(workload):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from pipeline.bench.workload import config, env_factory

    with initialize_config_dir(config_dir=str(BENCH_CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("bench", overrides=[f"bench_workload={workload}"])
    assert isinstance(cfg.num_envs, int) and cfg.num_envs >= 1 and cfg.repeats >= 1
    w = OmegaConf.to_container(cfg.bench_workload)
    assert set(w) == {"name", "overrides", "num_envs", "frames_per_batch"}, "a workload is a command's overrides"
    run_cfg = config(w)
    factory, encoder = BENCH_WORKLOADS[workload]
    assert (run_cfg.env.factory._target_, run_cfg.model.encoder) == (factory, encoder)
    assert (run_cfg.env.num_envs, run_cfg.trainer.frames_per_batch) == (w["num_envs"], w["frames_per_batch"])
    validate(run_cfg, cuda_available=False)
    assert callable(env_factory(w))


def test_trainer_env_specialisations_apply_to_their_pair_only():
    assert compose("env=atari").trainer.lr == pytest.approx(2.5e-4)
    assert compose("env=atari", "trainer.lr=0.01").trainer.lr == pytest.approx(0.01), "the command line wins"
    assert compose("env=atari", "trainer=dqn", "replay=uniform").trainer.learning_starts == 80000
    assert compose("trainer=dqn", "replay=uniform").trainer.learning_starts == 1000
    assert compose().trainer.lr == pytest.approx(2e-3)


def test_dqn_swaps_in_a_q_network_for_any_encoder():
    cfg = compose("trainer=dqn", "replay=uniform")
    assert (cfg.model._target_, cfg.model.encoder, list(cfg.model.hidden)) == ("components.models.QNetwork", "mlp", [256, 256])
    cfg = compose("env=atari", "trainer=dqn", "replay=uniform", "replay.storage=disk")
    assert (cfg.model._target_, cfg.model.encoder) == ("components.models.QNetwork", "nature_cnn")
    plan = resolve_plan(cfg, CPU_MACHINE)
    assert plan.choice("replay").facts["storage"] == "disk"


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
    (["collector.stall_timeout=0"], "collector.stall_timeout=0.0: must be > 0 seconds (or null: no stall watchdog)"),
    (["collector.driver_affinity=[99]"], "collector.driver_affinity=[99]: must be a non-empty list of usable CPUs"),
    (["chunking=fixed", "chunking.size=0"], "chunking.size=0: must be >= 1"),
    (["trainer.gamma=1.5"], "trainer.gamma=1.5: must be in (0, 1]"),
    (["workers.affinity=[[0]]"], "workers.affinity=[[0]]: only applies to workers=process"),
    (["trainer=dqn"], "replay.kind='none': trainer=dqn needs a replay buffer"),
    (["replay=uniform"], "replay.kind='uniform': trainer=ppo learns on-policy, use replay=none"),
    (["trainer=dqn", "replay=prioritized", "replay.beta=2"], "replay.beta=2.0: must be in [0, 1]"),
    (["trainer=dqn", "replay=uniform", "trainer.tau=0"], "trainer.tau=0.0: must be in (0, 1]"),
    (["device.trainer_device=cuda"], "device.trainer_device='cuda': CUDA is not available"),
    (["device.storing_device=cuda:1"], "device.storing_device='cuda:1': CUDA is not available"),
    (["device.policy_device=tpu"], "device.policy_device='tpu': must be cpu, cuda, cuda:N or auto"),
    (["server.static_batch_size=64"], "server.static_batch_size=64: CUDA graphs need device.policy_device=cuda"),
    (["workers=process", "server=process", "device.policy_device=mps"],
     "device.policy_device='mps': server=process needs a cpu or cuda policy"),
    (["trainer=dqn", "replay=uniform", "replay.storage=disk", "device.storing_device=mps"],
     "device.storing_device='mps': replay.storage=disk keeps transitions in memory-mapped host files"),
    (["trainer=dqn", "replay=uniform", "replay.frame_dedup=maybe"],
     "replay.frame_dedup='maybe': must be one of auto, true, false"),
    (["trainer=dqn", "replay=uniform", "replay.frame_dedup=1"], "replay.frame_dedup='1': must be one of auto, true, false"),
    (["trainer.name=dqn", "replay=uniform"],
     "trainer.name='dqn': the algorithm is chosen with the trainer group (trainer=dqn), not trainer.name"),
    (["trainer.name=dqn"], "trainer.name='dqn': the algorithm is chosen with the trainer group (trainer=dqn)"),
    (["trainer=dqn", "replay=uniform", "trainer.name=ppo"],
     "trainer.name='ppo': the algorithm is chosen with the trainer group (trainer=ppo), not trainer.name"),
    (["trainer.name=a2c"], "trainer.name='a2c': must be 'ppo', the algorithm of the trainer group"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_values_are_rejected_with_the_key_the_value_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(*overrides), cuda_available=False)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


BAD_WORDS = [
    (["transport.kind=wormhole"], "transport.kind='wormhole': must be one of auto, slots"),
    (["server.backend=gpu"], "server.backend='gpu': must be one of thread, process, inline"),
    (["workers=process", "workers.backend=banana"], "workers.backend='banana': must be one of auto, thread, process, ray"),
    (["trainer=dqn", "replay=uniform", "replay.storage=tape"], "replay.storage='tape': must be one of memory, disk"),
    (["server.engine=jax"], "server.engine='jax': must be one of auto, torch, numpy"),
    (["chunking.mode=Fixed"], "chunking.mode='Fixed': must be one of auto, step, fixed"),
    (["trainer.nan_policy=ignore"], "trainer.nan_policy='ignore': must be one of error, skip"),
    (["model.activation=gelu"], "model.activation='gelu': must be one of tanh, relu"),
    (["ray.scheduling=PACK"], "ray.scheduling='PACK': must be one of SPREAD, DEFAULT"),
    (["logger.mode=loud"], "logger.mode='loud': must be one of offline, online, disabled"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_WORDS, ids=[" ".join(o) for o, _ in BAD_WORDS])
def test_a_word_no_option_allows_is_rejected_while_composing_with_the_allowed_words(overrides, message):
    """Allowed words are enums of the schemas (components/kinds.py): composition itself refuses any other."""
    from hydra.errors import ConfigCompositionException

    from pipeline.__main__ import composition_error

    with pytest.raises(ConfigCompositionException) as err:
        compose(*overrides)
    assert composition_error(err.value) == message


def test_allowed_words_read_as_plain_strings_everywhere_downstream():
    import json

    cfg = compose("workers=process", "server=inline", "replay=none")
    assert cfg.server.backend == "inline" and str(cfg.server.backend) == "inline" and f"{cfg.workers.backend}" == "process"
    assert {"inline": 1}[cfg.server.backend] == 1
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert type(resolved["server"]["backend"]) is str and json.loads(json.dumps(resolved)) == resolved


@pytest.mark.parametrize("value", ["true", "false", "True", "FALSE", "auto", "AUTO"])
@pytest.mark.parametrize("replay", ["uniform", "prioritized"])
def test_frame_dedup_accepts_true_false_auto_in_any_case(replay, value):
    cfg = compose("trainer=dqn", f"replay={replay}", f"replay.frame_dedup={value}")
    validate(cfg, cuda_available=False)
    assert str(cfg.replay.frame_dedup).lower() == value.lower()


def test_frame_dedup_true_and_false_are_resolved_against_the_observations():
    """The documented values decide frame dedup (an Atari-shaped spec, no ALE needed); true on vectors is one line."""
    from components.envs import EnvSpec

    stacks = EnvSpec((4, 84, 84), "uint8", "discrete", action_n=6)
    vectors = EnvSpec((4,), "float32", "discrete", action_n=2)
    for value, on_stacks, on_vectors in (("true", True, None), ("TRUE", True, None), ("false", False, False),
                                         ("False", False, False), ("auto", True, False)):
        cfg = compose("trainer=dqn", "replay=uniform", f"replay.frame_dedup={value}")
        validate(cfg, cuda_available=False)
        assert resolve_plan(cfg, CPU_MACHINE, stacks).frame_dedup is on_stacks, value
        if on_vectors is None:
            with pytest.raises(ConfigError, match=r"^replay.frame_dedup=\S+: observations 4 float32 are not uint8"):
                resolve_plan(cfg, CPU_MACHINE, vectors)
        else:
            assert resolve_plan(cfg, CPU_MACHINE, vectors).frame_dedup is on_vectors, value


def test_device_keeps_only_the_keys_something_reads():
    assert set(compose().device) == {"policy_device", "trainer_device", "storing_device"}
    for option in ("cpu", "cuda", "auto"):
        assert set(compose(f"device={option}").device) == {"policy_device", "trainer_device", "storing_device"}


@pytest.mark.parametrize("key", ["device.env_device=cuda", "device.output_device=cpu"])
def test_removed_device_keys_are_hydra_errors(key):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose(key)


@pytest.mark.parametrize("overrides", [[], ["trainer=dqn", "replay=uniform"]], ids=["ppo", "dqn"])
def test_a_key_missing_from_any_node_is_one_config_error_line(overrides):
    """Every key validate reads: deleted, or left as ???, it is a ConfigError naming it, never a traceback."""
    base = compose(*overrides)
    keys = [
        f"{group}.{key}" for group in ("env", "workers", "transport", "server", "device", "chunking", "replay",
                                       "trainer", "logger")
        for key in base[group] if not OmegaConf.is_dict(base[group][key]) and key != "_target_"
    ] + ["seed", "torch_threads"]
    reported = set()
    for dotted in keys:
        for how in ("delete", "???"):
            cfg = copy.deepcopy(base)
            *parents, leaf = dotted.split(".")
            node = cfg
            for part in parents:
                node = node[part]
            with open_dict(node):
                if how == "delete":
                    del node[leaf]
                else:
                    node[leaf] = "???"
            try:
                validate(cfg, cuda_available=False, check_env=False)
            except ConfigError as err:
                message = str(err)
                assert "\n" not in message
                if dotted in message:
                    reported.add(dotted)
    # the keys validate reads are reported by name (a few, e.g. model/progress, it never reads)
    for must in ("env.num_envs", "workers.backend", "server.max_batch_size", "device.policy_device", "replay.kind",
                 "trainer.name", "trainer.lr", "logger.sinks", "seed"):
        assert must in reported, must
    if overrides:
        assert {"trainer.updates_per_batch", "replay.capacity", "replay.frame_dedup"} <= reported
    else:
        assert {"trainer.clip_coef", "trainer.minibatches"} <= reported


def test_a_trainer_node_of_no_known_algorithm_is_one_line():
    cfg = compose()
    with open_dict(cfg.trainer):
        del cfg.trainer["clip_coef"]
    with pytest.raises(ConfigError, match=r"^trainer=<unknown>: must be a trainer group option"):
        validate(cfg, cuda_available=False)


def test_the_algorithm_comes_from_the_trainer_node_not_its_target():
    cfg = compose("trainer=dqn", "replay=uniform")
    with open_dict(cfg.trainer):
        cfg.trainer["_target_"] = "somewhere.else.Trainer"
    validate(cfg, cuda_available=False)
    cfg = compose()
    with open_dict(cfg.trainer):
        del cfg.trainer["_target_"]
    validate(cfg, cuda_available=False)


def _run_dir(args: list[str], tmp_path: Path) -> Path:
    return tmp_path / "_".join(a.replace("=", "-").replace("[", "").replace("]", "") for a in args)


def _cli(cases: list[list[str]], tmp_path: Path) -> list[dict]:
    """Each case as ``python -m pipeline`` (forked from one interpreter: tests/cli_forks.py), side by side."""
    import os

    from tests.cli_forks import run_forked

    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    return run_forked([[*args, f"hydra.run.dir={_run_dir(args, tmp_path)}"] for args in cases], ROOT, env)


def test_a_user_sees_one_line_exit_code_2_and_no_traceback_and_hydra_reports_its_own_errors(tmp_path):
    cases = [["server.max_batch_size=0"], ["env.id=NoSuchEnv-v0"], ["device=cuda"], ["chunking.chunks_per_worker=2"],
             ["env=gym", "env.id=Pendulum-v1", "trainer=dqn", "replay=uniform"], ["trainer.name=dqn", "replay=uniform"]]
    *ours, banana, typo = _cli([*cases, ["workers=banana"], ["server.max_batch_sise=4"]], tmp_path)
    for args, result in zip(cases, ours):
        out, err = result["stdout"], result["stderr"]
        lines = [line for line in err.splitlines() if line.strip()]
        assert result["returncode"] == 2, (args, err)
        assert len(lines) == 1 and lines[0].startswith("config error: "), (args, err)
        assert "Traceback" not in out + err
        assert not (_run_dir(args, tmp_path) / "metrics.jsonl").exists(), "nothing starts on a bad config"
    assert banana["returncode"] != 0 and "workers/banana" in banana["stderr"]
    assert typo["returncode"] != 0 and "max_batch_sise" in typo["stderr"]


# ------------------------------------------------------------------ auto plan
def test_envs_per_worker_auto_leaves_a_cpu_for_the_inference_server():
    plan = resolve_plan(compose("env=atari"), Machine(cpus=2, cuda=False))
    assert (plan.graph.num_workers, plan.graph.envs_per_worker, plan.graph.splits) == (1, 16, 2)
    per_worker = plan.choice("workers").facts["per_worker"]
    assert (per_worker.code, per_worker.facts["workers"]) == ("auto.cpu_left_for_server", 1)
    plan = resolve_plan(compose("env=atari"), Machine(cpus=8, cuda=False))
    assert (plan.graph.num_workers, plan.graph.envs_per_worker) == (6, 3)
    plan = resolve_plan(compose(), CPU_MACHINE)
    assert (plan.graph.num_workers, plan.graph.envs_per_worker) == (1, 8)
    plan = resolve_plan(compose("workers=process", "env.envs_per_worker=2"), CPU_MACHINE)
    assert plan.graph.num_workers == 4


def test_transport_auto_gives_thread_workers_the_servers_slots_directly():
    plan = resolve_plan(compose(), CPU_MACHINE)
    assert (plan.graph.workers, plan.graph.server) == ("thread", "thread")
    assert plan.choice("transport").code == "auto.slots"
    assert plan.graph.chunk_len == 1 and plan.choice("chunking").code == "auto.thread_workers"


def test_transport_auto_with_process_workers_uses_slots_and_a_process_server():
    plan = resolve_plan(compose("workers=process"), CPU_MACHINE)
    assert plan.graph.server == "process" and plan.choice("transport").code == "auto.slots_server_to_process"
    plan = resolve_plan(compose("workers=process", "server=process"), CPU_MACHINE)
    assert plan.choice("transport").code == "auto.slots"


COMBINATIONS = [
    # workers, transport, server -> resolved transport, server, the rule that decided it
    ("thread", "auto", "thread", "slots", "thread", "auto.slots"),
    ("thread", "auto", "process", "slots", "process", "auto.slots"),
    ("thread", "slots", "thread", "slots", "thread", "given"),
    ("thread", "slots", "process", "slots", "process", "given"),
    ("process", "auto", "thread", "slots", "process", "auto.slots_server_to_process"),
    ("process", "auto", "process", "slots", "process", "auto.slots"),
    ("process", "slots", "thread", "slots", "thread", "given"),
    ("process", "slots", "process", "slots", "process", "given"),
]


@pytest.mark.parametrize(("workers", "transport", "server", "want_transport", "want_server", "code"), COMBINATIONS)
def test_every_combination_resolves_with_a_reason(workers, transport, server, want_transport, want_server, code):
    cfg = compose(f"workers={workers}", f"transport={transport}", f"server={server}")
    validate(cfg, cuda_available=False)
    plan = resolve_plan(cfg, CPU_MACHINE)
    assert plan.graph.server == want_server and plan.choice("transport").value == want_transport
    assert plan.choice("transport").code == code and plan.reason("transport")
    assert str(plan).splitlines()[0] == "plan:" and any(line.strip().startswith("transport") for line in str(plan).splitlines())


def test_auto_keeps_the_server_in_the_driver_when_the_policy_device_cannot_be_shared():
    cfg = compose("workers=process", "device.policy_device=mps")
    plan = resolve_plan(cfg, CPU_MACHINE)
    transport = plan.choice("transport")
    assert plan.graph.server == "thread" and transport.code == "auto.slots_server_unshareable"
    assert transport.facts["policy_device"] == "mps"


def test_explicit_choices_are_kept():
    plan = resolve_plan(compose("workers=process", "transport=slots", "server=thread"), CPU_MACHINE)
    assert plan.graph.server == "thread" and plan.choice("transport").code == "given"
    plan = resolve_plan(compose("workers=process", "transport=slots", "server=process"), CPU_MACHINE)
    assert plan.graph.server == "process"


def test_every_auto_choice_is_said_in_the_plan():
    from components.envs import EnvSpec

    plan = resolve_plan(compose(), CPU_MACHINE)
    assert plan.server.engine == "numpy" and plan.choice("server").facts["engine"].code == "auto.small_mlp_on_cpu"
    plan = resolve_plan(compose("env=atari"), CPU_MACHINE)
    engine = plan.choice("server").facts["engine"]
    assert plan.server.engine == "torch" and (engine.code, engine.facts["encoder"]) == ("auto.torch_encoder", "nature_cnn")
    plan = resolve_plan(compose("server.engine=torch"), CPU_MACHINE)
    assert plan.server.engine == "torch"
    frames = EnvSpec((4, 84, 84), "uint8", "discrete", action_n=6)
    plan = resolve_plan(compose("env=atari", "trainer=dqn", "replay=uniform"), CPU_MACHINE, frames)
    dedup = plan.choice("replay").facts["dedup"]
    assert plan.frame_dedup is True and (dedup.code, dedup.facts["shape"]) == ("auto.on", "4x84x84")
    vectors = EnvSpec((4,), "float32", "discrete", action_n=2)
    plan = resolve_plan(compose("trainer=dqn", "replay=uniform"), CPU_MACHINE, vectors)
    assert plan.frame_dedup is False and plan.choice("replay").facts["dedup"].code == "auto.off"
    with pytest.raises(ConfigError, match="replay.frame_dedup=True: observations 4 float32 are not uint8 frame stacks"):
        resolve_plan(compose("trainer=dqn", "replay=uniform", "replay.frame_dedup=true"), CPU_MACHINE, vectors)


@pytest.mark.parametrize(("overrides", "fewest"), [
    (["chunking.chunks_per_worker=2"], 33),  # 8 thread envs, 1 step per chunk, 256 per batch: 263 needed
    (["workers=process", "env.num_envs=8", "env.envs_per_worker=4", "chunking.chunks_per_worker=1"], 3),
])
def test_a_chunk_budget_that_cannot_hold_a_batch_is_a_config_error(overrides, fewest):
    with pytest.raises(ConfigError, match=rf"chunking.chunks_per_worker=\d+: .* use at least {fewest} \(or null\)"):
        resolve_plan(compose(*overrides), CPU_MACHINE)
    resolve_plan(compose(*[o for o in overrides if "chunks_per_worker" not in o], f"chunking.chunks_per_worker={fewest}"),
                 CPU_MACHINE)


def test_a_block_larger_than_max_batch_size_is_served_in_slices():
    plan = resolve_plan(compose("server.max_batch_size=3"), CPU_MACHINE)
    assert plan.choice("server").facts["passes"] == 3


def test_device_auto_says_what_it_found():
    cfg = compose("device=auto")
    assert resolve_plan(cfg, CPU_MACHINE).server.device == "cpu"
    assert resolve_plan(cfg, CPU_MACHINE).choice("server").facts["device"].code == "auto.no_cuda"
    gpu = resolve_plan(cfg, GPU_MACHINE)
    assert gpu.server.device == "cuda" and gpu.trainer_device == "cuda"


@pytest.mark.parametrize(("overrides", "chunk_len"), [
    (["workers=process", "env.num_envs=8", "env.envs_per_worker=4", "trainer.frames_per_batch=256"], 16),
    (["workers=process", "env.num_envs=64", "env.envs_per_worker=32", "trainer.frames_per_batch=1024"], 4),
    (["workers=process", "env.num_envs=2", "env.envs_per_worker=1", "trainer.frames_per_batch=16"], 16),
    (["workers=process", "env.num_envs=4", "env.envs_per_worker=4", "trainer.frames_per_batch=8"], 2),
    (["workers=process", "chunking=step"], 1),
    (["chunking=fixed", "chunking.size=7"], 7),
])
def test_chunking_auto_follows_its_rule(overrides, chunk_len):
    plan = resolve_plan(compose(*overrides), CPU_MACHINE)
    assert plan.graph.chunk_len == chunk_len


def test_server_inline_has_no_transport_one_block_per_worker_and_a_cpu_policy():
    plan = resolve_plan(compose("workers=process", "server=inline"), CPU_MACHINE)
    g = plan.graph
    assert (g.server, g.splits, g.num_workers) == ("inline", 1, CPU_MACHINE.cpus)
    assert plan.choice("transport").code == "inline"
    workers = plan.choice("workers").facts
    assert (workers["blocks"].code, workers["per_worker"].code) == ("inline.one_block", "auto.worker_per_cpu")
    assert plan.server.engine == "numpy" and plan.choice("server").value == "inline"
    gpu = resolve_plan(compose("server=inline", "device=auto"), GPU_MACHINE)
    device = gpu.choice("server").facts["device"]
    assert gpu.server.device == "cpu" and (device.code, device.facts["asked"].code) == ("inline.cpu", "auto.cuda")
    with pytest.raises(ConfigError, match="server=inline runs a copy of the policy on each env worker's CPU"):
        validate(compose("server=inline", "device=cuda"), cuda_available=True, cuda_count=1)
