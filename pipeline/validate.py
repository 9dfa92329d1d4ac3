"""Value checks on a composed config, before anything is built or started.

Types and key names are already enforced by the schemas at compose time;
here live ranges, allowed words, cross-group rules and facts about the
machine (is there CUDA, do those CPUs exist, is that env id registered).
Each failure is one :class:`ConfigError` line naming the key, the value and
what is allowed; the runner prints it and exits with code 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from components.envs import EnvConfigError, check_env_id
from components.metrics import KINDS as LOGGER_KINDS


class ConfigError(ValueError):
    """A config value the run cannot start with (printed as one line, exit code 2)."""


def _get(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check(cfg: DictConfig, key: str, ok: Callable[[Any], bool], allowed: str) -> None:
    value = _get(cfg, key)
    if not ok(value):
        raise ConfigError(f"{key}={value!r}: must be {allowed}")


def _one_of(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    _check(cfg, key, lambda v: v in choices, "one of " + ", ".join(choices))


_DEVICE = re.compile(r"^(cpu|auto|cuda(:\d+)?|mps)$")


def _check_device(cfg: DictConfig, key: str, cuda_available: bool, cuda_count: int) -> None:
    value = str(_get(cfg, key))
    if not _DEVICE.match(value):
        raise ConfigError(f"{key}={value!r}: must be cpu, cuda, cuda:N or auto")
    if value.startswith("cuda"):
        if not cuda_available:
            raise ConfigError(f"{key}={value!r}: CUDA is not available on this machine (allowed: cpu, auto)")
        index = int(value.split(":")[1]) if ":" in value else 0
        if index >= cuda_count:
            raise ConfigError(f"{key}={value!r}: this machine has {cuda_count} CUDA device(s)")


def validate(cfg: DictConfig, *, cuda_available: bool, cuda_count: int = 0, check_env: bool = True) -> None:
    """Raise :class:`ConfigError` for the first bad value in ``cfg``."""
    positive = (lambda v: v >= 1, ">= 1")
    non_negative = (lambda v: v >= 0, ">= 0")

    # env
    _check(cfg, "env.num_envs", *positive)
    if cfg.env.envs_per_worker is not None:
        _check(cfg, "env.envs_per_worker", *positive)
    _check(cfg, "workers.splits", *positive)
    _check(cfg, "workers.nice", lambda v: 0 <= v <= 19, "in [0, 19]")
    if check_env:
        try:
            check_env_id(str(cfg.env.id))
        except EnvConfigError as err:
            raise ConfigError(f"env.id={cfg.env.id!r}: {err}") from None

    # model
    _one_of(cfg, "model.encoder", ("mlp", "nature_cnn"))
    _one_of(cfg, "model.activation", ("tanh", "relu"))
    _check(cfg, "model.hidden", lambda v: len(v) > 0 and all(int(h) >= 1 for h in v), "a non-empty list of widths >= 1")

    # workers / transport / server
    _one_of(cfg, "workers.backend", ("thread", "process"))
    affinity = cfg.workers.affinity
    if affinity is not None:
        if cfg.workers.backend != "process":
            raise ConfigError(f"workers.affinity={list(affinity)!r}: only applies to workers=process")
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        for cpus in affinity:
            if not cpus or any(int(c) not in usable for c in cpus):
                raise ConfigError(
                    f"workers.affinity={[list(a) for a in affinity]!r}: every set must be non-empty and "
                    f"within the usable CPUs {sorted(usable)}"
                )
    _one_of(cfg, "transport.kind", ("auto", "driver", "slots"))
    if cfg.transport.kind == "slots" and cfg.workers.backend != "process":
        raise ConfigError("transport.kind='slots': needs workers=process (thread workers share the driver; use driver or auto)")
    _one_of(cfg, "server.backend", ("thread", "process"))
    for key in ("server.max_batch_size", "server.min_batch_size", "server.stats_window", "server.num_threads"):
        _check(cfg, key, *positive)
    if cfg.server.min_batch_size > cfg.server.max_batch_size:
        raise ConfigError(
            f"server.min_batch_size={cfg.server.min_batch_size}: must be <= server.max_batch_size={cfg.server.max_batch_size}"
        )
    _check(cfg, "server.timeout", *non_negative)
    _one_of(cfg, "server.engine", ("auto", "torch", "numpy"))

    # device
    for key in ("policy_device", "trainer_device", "output_device", "env_device", "storing_device"):
        _check_device(cfg, f"device.{key}", cuda_available, cuda_count)
    for key in ("output_device", "env_device"):
        value = str(cfg.device[key])
        if value not in ("cpu", "auto"):
            raise ConfigError(f"device.{key}={value!r}: must be cpu (env workers and shared buffers live on the host)")
    if cfg.transport.kind == "slots" and str(cfg.device.policy_device) not in ("cpu", "auto") \
            and not str(cfg.device.policy_device).startswith("cuda"):
        raise ConfigError(f"device.policy_device={cfg.device.policy_device!r}: transport=slots needs a cpu or cuda "
                          "policy (weights must be shareable with the inference process)")
    if cfg.replay.kind != "none" and cfg.replay.storage == "disk" and str(cfg.device.storing_device) not in ("cpu", "auto"):
        raise ConfigError(f"device.storing_device={cfg.device.storing_device!r}: replay.storage=disk keeps "
                          "transitions in memory-mapped host files (use storing_device=cpu)")
    if cfg.server.static_batch_size is not None:
        _check(cfg, "server.static_batch_size", lambda v: v >= 1, ">= 1 (or null)")
        if not str(cfg.device.policy_device).startswith(("cuda", "auto")):
            raise ConfigError(f"server.static_batch_size={cfg.server.static_batch_size}: CUDA graphs need "
                              f"device.policy_device=cuda (got {cfg.device.policy_device!r})")

    # chunking
    _one_of(cfg, "chunking.mode", ("auto", "step", "fixed"))
    if cfg.chunking.mode == "fixed":
        _check(cfg, "chunking.size", lambda v: v is not None and v >= 1, ">= 1 with chunking=fixed")
    if cfg.chunking.chunks_per_worker is not None:
        _check(cfg, "chunking.chunks_per_worker", lambda v: v >= 2, ">= 2 (or null)")

    # replay / trainer
    _one_of(cfg, "replay.kind", ("none", "uniform", "prioritized"))
    _one_of(cfg, "trainer.name", ("ppo", "dqn"))
    t = cfg.trainer
    if t.name == "ppo" and cfg.replay.kind != "none":
        raise ConfigError(f"replay.kind={cfg.replay.kind!r}: trainer=ppo learns on-policy, use replay=none")
    if t.name == "dqn" and cfg.replay.kind == "none":
        raise ConfigError("replay.kind='none': trainer=dqn needs a replay buffer (replay=uniform or replay=prioritized)")
    if cfg.replay.kind != "none":
        _one_of(cfg, "replay.storage", ("memory", "disk"))
        _one_of(cfg, "replay.frame_dedup", ("auto", "true", "false"))
        _check(cfg, "replay.capacity", *positive)
        _check(cfg, "replay.alpha", *non_negative)
        _check(cfg, "replay.beta", lambda v: 0 <= v <= 1, "in [0, 1]")
        _check(cfg, "replay.eps", lambda v: v > 0, "> 0")
        if cfg.replay.max_policy_lag is not None:
            _check(cfg, "replay.max_policy_lag", *non_negative)
    for key in ("frames_per_batch", "total_frames", "target_window"):
        _check(cfg, f"trainer.{key}", *positive)
    _check(cfg, "trainer.lr", lambda v: v > 0, "> 0")
    _check(cfg, "trainer.gamma", lambda v: 0 < v <= 1, "in (0, 1]")
    _check(cfg, "trainer.max_grad_norm", *non_negative)
    if t.name == "ppo":
        for key in ("epochs", "minibatches"):
            _check(cfg, f"trainer.{key}", *positive)
        _check(cfg, "trainer.max_policy_lag", *non_negative)
        _check(cfg, "trainer.gae_lambda", lambda v: 0 <= v <= 1, "in [0, 1]")
        _check(cfg, "trainer.clip_coef", lambda v: v > 0, "> 0")
        for key in ("ent_coef", "vf_coef"):
            _check(cfg, f"trainer.{key}", *non_negative)
        if t.minibatches > t.frames_per_batch:
            raise ConfigError(f"trainer.minibatches={t.minibatches}: must be <= trainer.frames_per_batch={t.frames_per_batch}")
    else:
        for key in ("batch_size", "updates_per_batch", "target_update_period", "n_step"):
            _check(cfg, f"trainer.{key}", *positive)
        _check(cfg, "trainer.learning_starts", *non_negative)
        _check(cfg, "trainer.tau", lambda v: 0 < v <= 1, "in (0, 1]")
        for key in ("eps_start", "eps_end"):
            _check(cfg, f"trainer.{key}", lambda v: 0 <= v <= 1, "in [0, 1]")
        _check(cfg, "trainer.eps_fraction", lambda v: 0 < v <= 1, "in (0, 1]")
        if t.batch_size > cfg.replay.capacity:
            raise ConfigError(f"trainer.batch_size={t.batch_size}: must be <= replay.capacity={cfg.replay.capacity}")

    # logger / top level
    _one_of(cfg, "logger.kind", LOGGER_KINDS)
    _check(cfg, "logger.interval", lambda v: v > 0, "> 0 seconds")
    if cfg.logger.mode is not None:
        _one_of(cfg, "logger.mode", ("offline", "online", "disabled"))
    _check(cfg, "torch_threads", *positive)
    _check(cfg, "seed", *non_negative)
