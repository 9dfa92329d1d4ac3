"""Value checks on a composed config, before anything is built or started.

Types, key names and allowed words (:mod:`components.kinds`) are already
enforced by the schemas at compose time;
here live ranges, cross-group rules and facts about the
machine (is there CUDA, do those CPUs exist, is that env id registered).
Each failure is one :class:`ConfigError` line, ``key=value: what is
allowed``; the runner prints it and exits with code 2. A key missing from
the config is such a line too, never a traceback.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from components.envs import EnvConfigError, check_env_id
from components.kinds import Word
from components.metrics import check_sinks
from pipeline.plan.eval_settings import EvalConfigError, check_eval


class ConfigError(ValueError):
    """A config value the run cannot start with (printed as one line, exit code 2)."""


def import_target(key: str, target: str) -> Any:
    """The class or callable a ``_target_`` names; a :class:`ConfigError` naming ``key`` when it cannot be imported."""
    import importlib

    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{key}={target!r}: cannot import it ({type(err).__name__}: {err})") from None


def _one_line(message: str) -> str:
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def _first_line(message: str) -> str:
    return next((line.strip() for line in str(message).splitlines() if line.strip()), "")


def _get(cfg: DictConfig, key: str, allowed: str = "set by its config group") -> Any:
    """``cfg[key]`` for a dotted key; a missing, unset or unresolvable key is a :class:`ConfigError`."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node.keys():
            raise ConfigError(f"{key}=<missing>: must be {allowed} (the key is not in the composed config)")
        if OmegaConf.is_missing(node, part):
            raise ConfigError(f"{key}=???: must be {allowed} (no value was given)")
        try:
            node = node[part]
        except OmegaConfBaseException as err:  # a broken interpolation
            raise ConfigError(f"{key}=<unresolved>: must be {allowed} ({_first_line(str(err))})") from None
    return str(node) if isinstance(node, Word) else node  # an allowed word, said as the user wrote it


def _check(cfg: DictConfig, key: str, ok: Callable[[Any], bool], allowed: str) -> None:
    value = _get(cfg, key, allowed)
    try:
        good = bool(ok(value))
    except (TypeError, ValueError, AttributeError):  # e.g. None where a number belongs
        good = False
    if not good:
        raise ConfigError(f"{key}={value!r}: must be {allowed}")


def _one_of(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    _check(cfg, key, lambda v: v in choices, "one of " + ", ".join(choices))


#: what a sweep job may return (``sweep.objective``): keys of the run's summary row
OBJECTIVES = ("episode/return_mean", "collector/frames_per_s", "wall_time_s")

_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?|mps)$")
_DEVICE_KEYS = ("policy_device", "trainer_device", "storing_device")
_FRAME_DEDUP = ("auto", "true", "false")

#: a key only one algorithm's trainer node has -> that algorithm
_ALGORITHM_KEYS = (("updates_per_batch", "dqn"), ("clip_coef", "ppo"), ("updates_per_frame", "sac"))
#: the trainer group's options
ALGORITHMS = ("ppo", "dqn", "sac")


_DOTTED_CLASS = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def _check_extra_sinks(paths: list[Any]) -> None:
    """``logger.extra_sinks``: distinct ``module.Class`` paths (imported in the sinks process, not here)."""
    for path in paths:
        if not isinstance(path, str) or not _DOTTED_CLASS.match(path):
            raise ConfigError(f"logger.extra_sinks: {path!r} is not a module.Class path (e.g. mypackage.sinks.MySink)")
    if len(set(paths)) != len(paths):
        raise ConfigError(f"logger.extra_sinks={paths}: a sink is listed twice")


def _check_device(cfg: DictConfig, key: str, cuda_available: bool, cuda_count: int) -> None:
    value = str(_get(cfg, key, "cpu, cuda, cuda:N or auto"))
    if not _DEVICE.match(value):
        raise ConfigError(f"{key}={value!r}: must be cpu, cuda, cuda:N or auto")
    if value.startswith("cuda"):
        if not cuda_available:
            raise ConfigError(f"{key}={value!r}: CUDA is not available on this machine (allowed: cpu, auto)")
        index = int(value.split(":")[1]) if ":" in value else 0
        if index >= cuda_count:
            raise ConfigError(f"{key}={value!r}: this machine has {cuda_count} CUDA device(s)")


def _check_sac(cfg: DictConfig) -> None:
    positive = (lambda v: v > 0, "> 0")
    for key in ("batch_size", "policy_frequency", "target_update_period", "n_step"):
        _check(cfg, f"trainer.{key}", *positive)
    _check(cfg, "trainer.updates_per_frame", lambda v: math.isfinite(v) and v > 0,
           "> 0 (critic gradient steps per collected transition, e.g. 1.0)")
    _check(cfg, "trainer.learning_starts", lambda v: v >= 0, ">= 0")
    _check(cfg, "trainer.tau", lambda v: 0 < v <= 1, "in (0, 1]")
    _check(cfg, "trainer.alpha", lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
    if _get(cfg, "trainer.target_entropy", "a number or null") is not None:
        _check(cfg, "trainer.target_entropy", math.isfinite, "a finite number (or null: -|A|)")
    hidden = _get(cfg, "trainer.critic_hidden", "a list of widths")
    if not hidden or any(int(h) < 1 for h in hidden):
        raise ConfigError(f"trainer.critic_hidden={list(hidden) if hidden else hidden}: must be a non-empty list of "
                          "widths >= 1")
    _one_of(cfg, "trainer.critic_activation", ("relu", "tanh"))
    batch_size, capacity = _get(cfg, "trainer.batch_size", "> 0"), _get(cfg, "replay.capacity", "> 0")
    if batch_size > capacity:
        raise ConfigError(f"trainer.batch_size={batch_size}: must be <= replay.capacity={capacity}")


def trainer_algorithm(cfg: DictConfig) -> str:
    """The algorithm the trainer group composed (``ppo``, ``dqn`` or ``sac``), read from the node's keys.

    ``trainer.name`` is only a label; a DQN node has ``updates_per_batch``,
    a PPO node ``clip_coef``, a SAC node ``updates_per_frame``.
    """
    node = _get(cfg, "trainer", "a trainer group option (trainer=ppo, trainer=dqn or trainer=sac)")
    if isinstance(node, DictConfig):
        for key, algorithm in _ALGORITHM_KEYS:
            if key in node:
                return algorithm
    raise ConfigError("trainer=<unknown>: must be a trainer group option, trainer=ppo, trainer=dqn or trainer=sac "
                      "(the node has none of trainer.clip_coef, trainer.updates_per_batch, trainer.updates_per_frame)")


def validate(cfg: DictConfig, *, cuda_available: bool, cuda_count: int = 0, check_env: bool = True) -> None:
    """Raise :class:`ConfigError` (one line) for the first bad value in ``cfg``."""
    try:
        _validate(cfg, cuda_available=cuda_available, cuda_count=cuda_count, check_env=check_env)
    except ConfigError as err:
        message = _one_line(str(err))
        if message == str(err):
            raise
        raise ConfigError(message) from None
    except OmegaConfBaseException as err:  # a safety net: every read above goes through _get
        key = getattr(err, "full_key", None) or "config"
        raise ConfigError(f"{key}: {_first_line(str(err))}") from None


def _validate_ray(cfg: DictConfig) -> None:
    """``ray.*`` (only read with ``workers=ray``), and Ray itself: a missing extra is one line, not a traceback."""
    address = str(_get(cfg, "ray.address"))
    if not address or not (address in ("local", "auto") or address.startswith("ray://") or ":" in address):
        raise ConfigError(f"ray.address={address!r}: must be local, auto, host:port or ray://host:port")
    if _get(cfg, "ray.num_actors") is not None:
        _check(cfg, "ray.num_actors", lambda v: v >= 1, ">= 1 (or null: one per ray.num_cpus_per_actor CPUs)")
    _check(cfg, "ray.num_cpus_per_actor", lambda v: v > 0, "> 0")
    if _get(cfg, "ray.chunk_len") is not None:
        _check(cfg, "ray.chunk_len", lambda v: v >= 1, ">= 1 (or null: auto)")
    _check(cfg, "ray.in_flight", lambda v: v >= 1, ">= 1")
    if _get(cfg, "chunking.chunks_per_worker") is not None:
        raise ConfigError("chunking.chunks_per_worker: not used with workers=ray (ray.in_flight bounds the chunks "
                          "each host has outstanding)")
    _check(cfg, "ray.start_timeout", lambda v: v > 0, "> 0 seconds")
    if _get(cfg, "collector.reset_at_each_iter"):
        raise ConfigError("collector.reset_at_each_iter=true: not available with workers=ray (hosts run ahead "
                          "of the batches the driver cuts)")
    from components.ray.cluster import INSTALL_HINT, ray_installed

    if not ray_installed():
        raise ConfigError(INSTALL_HINT)


def _validate(cfg: DictConfig, *, cuda_available: bool, cuda_count: int, check_env: bool) -> None:
    positive = (lambda v: v >= 1, ">= 1")
    non_negative = (lambda v: v >= 0, ">= 0")

    def get(key: str) -> Any:
        return _get(cfg, key)

    deterministic = bool(OmegaConf.select(cfg, "deterministic", default=False))
    if deterministic and str(get("workers.backend")) == "ray":
        raise ConfigError("deterministic=true: not available with workers=ray (hosts collect ahead of the trainer "
                          "and their chunks arrive in network order); use workers=thread or process")
    every = OmegaConf.select(cfg, "checkpoint.frames", default=None)
    if every is not None:
        _check(cfg, "checkpoint.frames", lambda v: v >= 1, ">= 1 frames (or null)")
        batch = int(get("trainer.frames_per_batch"))
        if deterministic and int(every) % batch:
            raise ConfigError(f"checkpoint.frames={every}: deterministic=true checkpoints between batches, so it "
                              f"must be a multiple of trainer.frames_per_batch={batch}")
    # env
    _check(cfg, "env.num_envs", *positive)
    if get("env.envs_per_worker") is not None:
        _check(cfg, "env.envs_per_worker", lambda v: v >= 1, ">= 1 (or null: auto)")
    _check(cfg, "workers.splits", *positive)
    _check(cfg, "workers.nice", lambda v: 0 <= v <= 19, "in [0, 19]")
    _check(cfg, "workers.max_restarts", lambda v: v >= 0, ">= 0 (0: a crashed worker fails the run)")
    _check(cfg, "workers.restart_window", lambda v: v > 0, "> 0 seconds")
    _check(cfg, "server.max_restarts", lambda v: v >= 0, ">= 0 (0: a dead server fails the run)")
    if get("server.step_timeout") is not None:
        _check(cfg, "server.step_timeout", lambda v: v > 0, "> 0 seconds (or null: no server hang watchdog)")
    try:
        check_eval(cfg)
    except EvalConfigError as err:
        raise ConfigError(str(err)) from None
    if get("workers.step_timeout") is not None:
        _check(cfg, "workers.step_timeout", lambda v: v > 0, "> 0 seconds (or null: no hang watchdog)")
    # the gymnasium registry is asked only when the factory makes its env from env.id (an own factory
    # that takes no id, e.g. the benchmark's frames env, names its env for the run directory only)
    factory = OmegaConf.select(cfg, "env.factory", default=None, throw_on_missing=False)
    if check_env and (not isinstance(factory, DictConfig) or "id" in list(factory.keys())):
        env_id = get("env.id")
        try:
            check_env_id(str(env_id))
        except EnvConfigError as err:
            raise ConfigError(f"env.id={env_id!r}: {err}") from None

    # model
    _check(cfg, "model.hidden", lambda v: len(v) > 0 and all(int(h) >= 1 for h in v), "a non-empty list of widths >= 1")
    _check(cfg, "model.obs_clip", lambda v: v > 0, "> 0")
    if get("model.obs_norm"):
        if get("model.encoder") != "mlp":
            raise ConfigError(f"model.obs_norm=true: normalises vector observations (model.encoder=mlp), not "
                              f"model.encoder={get('model.encoder')!r} (images are scaled by 1/255)")
        if "QNetwork" in str(get("model._target_")):
            raise ConfigError("model.obs_norm=true: implemented for actor-critics (trainer=ppo), not Q-networks")

    # workers / transport / server
    workers_backend = get("workers.backend")
    _check(cfg, "workers.concurrent_envs", lambda v: str(v).lower() in ("auto", "true", "false"),
           "auto, true or false")
    if workers_backend == "ray" and str(get("workers.concurrent_envs")).lower() == "true":
        raise ConfigError("workers.concurrent_envs=true: applies to thread and process workers; each Ray env "
                          "host steps its envs as one block")
    if workers_backend == "ray":
        _validate_ray(cfg)
    affinity = get("workers.affinity")
    if affinity is not None:
        if workers_backend != "process":
            raise ConfigError(f"workers.affinity={list(affinity)!r}: only applies to workers=process")
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        for cpus in affinity:
            if not cpus or any(int(c) not in usable for c in cpus):
                raise ConfigError(
                    f"workers.affinity={[list(a) for a in affinity]!r}: every set must be non-empty and "
                    f"within the usable CPUs {sorted(usable)}"
                )
    for key in ("server.max_batch_size", "server.min_batch_size", "server.stats_reservoir", "server.num_threads"):
        _check(cfg, key, *positive)
    min_batch, max_batch = get("server.min_batch_size"), get("server.max_batch_size")
    if min_batch > max_batch:
        raise ConfigError(f"server.min_batch_size={min_batch}: must be <= server.max_batch_size={max_batch}")
    _check(cfg, "server.timeout", *non_negative)

    # device (env workers, shared buffers and server responses always live in host memory)
    for key in _DEVICE_KEYS:
        _check_device(cfg, f"device.{key}", cuda_available, cuda_count)
    policy_device, storing_device = str(get("device.policy_device")), str(get("device.storing_device"))
    if get("server.backend") == "process" and policy_device not in ("cpu", "auto") \
            and not policy_device.startswith("cuda"):
        raise ConfigError(f"device.policy_device={policy_device!r}: server=process needs a cpu or cuda "
                          "policy (weights must be shareable with the inference process; use server=thread)")
    if get("server.backend") == "inline" and policy_device not in ("cpu", "auto"):
        raise ConfigError(f"device.policy_device={policy_device!r}: server=inline runs a copy of the policy on "
                          "each env worker's CPU (use server=process or server=thread for an accelerator)")
    replay_kind = get("replay.kind")
    if replay_kind != "none" and get("replay.storage") == "disk" and storing_device not in ("cpu", "auto"):
        raise ConfigError(f"device.storing_device={storing_device!r}: replay.storage=disk keeps "
                          "transitions in memory-mapped host files (use storing_device=cpu)")
    static_batch = get("server.static_batch_size")
    if static_batch is not None:
        _check(cfg, "server.static_batch_size", lambda v: v >= 1, ">= 1 (or null)")
        if not policy_device.startswith(("cuda", "auto")):
            raise ConfigError(f"server.static_batch_size={static_batch}: CUDA graphs need "
                              f"device.policy_device=cuda (got {policy_device!r})")

    # chunking
    if get("chunking.mode") == "fixed":
        _check(cfg, "chunking.size", lambda v: v is not None and v >= 1, ">= 1 with chunking=fixed")
    if get("chunking.chunks_per_worker") is not None:
        _check(cfg, "chunking.chunks_per_worker", lambda v: v >= 1, ">= 1 (or null: one batch ahead)")

    # collector
    stall = get("collector.stall_timeout")
    if stall is not None:
        _check(cfg, "collector.stall_timeout", lambda v: v > 0, "> 0 seconds (or null: no stall watchdog)")
    _check(cfg, "collector.policy_version", *non_negative)
    driver_cpus = get("collector.driver_affinity")
    if driver_cpus is not None:
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        if not driver_cpus or any(int(c) not in usable for c in driver_cpus):
            raise ConfigError(f"collector.driver_affinity={list(driver_cpus)!r}: must be a non-empty list of "
                              f"usable CPUs {sorted(usable)} (or null)")

    # replay / trainer: the trainer group decides the algorithm, trainer.name must agree
    algorithm = trainer_algorithm(cfg)
    name = get("trainer.name")
    if name != algorithm:
        if name in ALGORITHMS:
            raise ConfigError(f"trainer.name={name!r}: the algorithm is chosen with the trainer group "
                              f"(trainer={name}), not trainer.name (this config composes trainer={algorithm})")
        raise ConfigError(f"trainer.name={name!r}: must be {algorithm!r}, the algorithm of the trainer group "
                          f"(choose it with trainer=ppo, trainer=dqn or trainer=sac)")
    if algorithm == "ppo" and replay_kind != "none":
        raise ConfigError(f"replay.kind={replay_kind!r}: trainer=ppo learns on-policy, use replay=none")
    if algorithm in ("dqn", "sac") and replay_kind == "none":
        raise ConfigError(f"replay.kind='none': trainer={algorithm} needs a replay buffer (replay=uniform or "
                          "replay=prioritized)")
    if replay_kind != "none":
        # YAML and Hydra read true/false as booleans and the str field keeps them as 'True'/'False'
        _check(cfg, "replay.frame_dedup", lambda v: str(v).lower() in _FRAME_DEDUP,
               "one of " + ", ".join(_FRAME_DEDUP) + " (any case)")
        _check(cfg, "replay.capacity", *positive)
        _check(cfg, "replay.alpha", *non_negative)
        _check(cfg, "replay.beta", lambda v: 0 <= v <= 1, "in [0, 1]")
        _check(cfg, "replay.eps", lambda v: v > 0, "> 0")
        if get("replay.max_policy_lag") is not None:
            _check(cfg, "replay.max_policy_lag", lambda v: v >= 0, ">= 0 (or null)")
        if get("replay.checkpoint_max_mb") is not None:
            _check(cfg, "replay.checkpoint_max_mb", lambda v: v >= 0, ">= 0 MB (or null: never in checkpoints)")
    for key in ("frames_per_batch", "total_frames", "target_window"):
        _check(cfg, f"trainer.{key}", *positive)
    learning_rate = (lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
    for key in ("actor_lr", "critic_lr", "alpha_lr") if algorithm == "sac" else ("lr",):
        _check(cfg, f"trainer.{key}", *learning_rate)
    _check(cfg, "trainer.gamma", lambda v: 0 < v <= 1, "in (0, 1]")
    if algorithm != "sac" or get("trainer.max_grad_norm") is not None:
        _check(cfg, "trainer.max_grad_norm", *non_negative)
    frames_per_batch = get("trainer.frames_per_batch")
    if algorithm == "ppo":
        for key in ("epochs", "minibatches"):
            _check(cfg, f"trainer.{key}", *positive)
        _check(cfg, "trainer.max_policy_lag", *non_negative)
        _check(cfg, "trainer.gae_lambda", lambda v: 0 <= v <= 1, "in [0, 1]")
        _check(cfg, "trainer.clip_coef", lambda v: v > 0, "> 0")
        for key in ("ent_coef", "vf_coef"):
            _check(cfg, f"trainer.{key}", *non_negative)
        if get("trainer.seq_len") is not None:
            _check(cfg, "trainer.seq_len", lambda v: v >= 1, ">= 1 (or null: whole trajectories)")
        if get("model.rnn") is not None and get("model.rnn_hidden") < 1:
            raise ConfigError(f"model.rnn_hidden={get('model.rnn_hidden')}: must be >= 1")
        if get("model.rnn") is not None and get("model.rnn_layers") < 1:
            raise ConfigError(f"model.rnn_layers={get('model.rnn_layers')}: must be >= 1")
        minibatches = get("trainer.minibatches")
        if minibatches > frames_per_batch:
            raise ConfigError(f"trainer.minibatches={minibatches}: must be <= trainer.frames_per_batch={frames_per_batch}")
    elif algorithm == "sac":
        _check_sac(cfg)
    else:
        for key in ("batch_size", "updates_per_batch", "target_update_period", "n_step"):
            _check(cfg, f"trainer.{key}", *positive)
        _check(cfg, "trainer.learning_starts", *non_negative)
        _check(cfg, "trainer.tau", lambda v: 0 < v <= 1, "in (0, 1]")
        for key in ("eps_start", "eps_end"):
            _check(cfg, f"trainer.{key}", lambda v: 0 <= v <= 1, "in [0, 1]")
        _check(cfg, "trainer.eps_fraction", lambda v: 0 < v <= 1, "in (0, 1]")
        batch_size, capacity = get("trainer.batch_size"), get("replay.capacity")
        if batch_size > capacity:
            raise ConfigError(f"trainer.batch_size={batch_size}: must be <= replay.capacity={capacity}")

    # logger / top level
    sinks = get("logger.sinks")
    try:
        check_sinks(list(sinks))
    except ValueError as err:
        raise ConfigError(f"logger.sinks={list(sinks)}: {err}") from None
    _check(cfg, "logger.interval", lambda v: v > 0, "> 0 seconds")
    _check(cfg, "logger.wandb_timeout", lambda v: v > 0, "> 0 seconds")
    _check(cfg, "logger.rows_per_run", lambda v: v >= 0, ">= 0 (0: a row every logger.interval only)")
    _check(cfg, "logger.queue_rows", lambda v: v >= 1, ">= 1 rows")
    _check_extra_sinks(list(get("logger.extra_sinks") or []))
    _one_of(cfg, "sweep.objective", OBJECTIVES)
    _check(cfg, "torch_threads", *positive)
    _check(cfg, "seed", *non_negative)
