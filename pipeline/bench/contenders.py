"""The benchmark's contenders, each measured in a fresh process by :func:`trial_main`.

Every contender collects from the same env factory with the same policy
(the same network, executed by the same serving engine), steps for a
warm-up that is not timed, then counts frames for ``seconds``:

* ``ours:auto``, ``ours:train``, ``ours:<workers>/<transport>/<server>/<chunking>``, ``ours:ray``:
  this project's collector, as a ``python -m pipeline`` command with those
  overrides would plan and build it (:mod:`pipeline.bench.ours`); the
  consumer only takes batches (no training).
* ``gym_sync`` / ``gym_async``: a gymnasium ``SyncVectorEnv`` /
  ``AsyncVectorEnv(shared_memory=True)`` loop, one batched forward per step.
* ``bare_procs``: no collector, one hand-written loop per CPU, each stepping
  its envs in turn and running its own policy copy (:mod:`pipeline.bench.bare`):
  what this machine gives the workload, against which the limit's sum of
  separately probed costs is optimistic.
* ``torchrl_auto`` / ``torchrl_driver``: TorchRL's ``AsyncBatchedCollector``
  (when torchrl is installed) with ``transport="auto"`` / ``"driver"``.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.bench.ours import layout_overrides, run_ours, timed
from pipeline.bench.workload import LoopPolicy, engine as workload_engine, env_factory, model_spec, recurrent_variant

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
#: BLAS/OpenMP/torch threads of every trial process and of what it starts (gymnasium's and TorchRL's
#: workers, the bare loops inherit them), as ``python -m pipeline`` gives its driver by default
#: (``torch_threads``): every contender runs its policy the same way.
TRIAL_THREADS = 1
#: the loops ours is held against (gymnasium's and the hand loop), and TorchRL's collector when installed
BASELINES = ["gym_sync", "gym_async", "bare_procs"]
TORCHRL = ["torchrl_auto", "torchrl_driver"]
#: the contenders that are not ours (each may end in a recurrent suffix, ``+lstm[N]`` or ``+gru[N]``)
LOOPS = (*BASELINES, *TORCHRL)


def check_contender(name: str) -> None:
    """A ``ValueError`` saying what is wrong with a contender name: checked before any trial starts.

    A name the trials cannot run would otherwise be found one trial at a
    time, each recorded as failed, minutes into the run, with exit 0.

    Examples:
        >>> check_contender("ours:process/slots/thread/auto@epw=4+lstm128")
        >>> check_contender("gym_snyc")
        Traceback (most recent call last):
        ...
        ValueError: unknown contender 'gym_snyc': ours:auto, ours:train, ours:<workers>/<transport>/<server>/<chunking>[@opt=value,...], ours:ray[@address=HOST:PORT], gym_sync, gym_async, bare_procs, torchrl_auto, torchrl_driver (each may end in +lstm[N] or +gru[N])
    """
    base, _ = recurrent_variant(name, {})
    if base.startswith("ours:"):
        layout_overrides(base)  # its own ValueError names the part that is wrong
    elif base not in LOOPS:
        raise ValueError(f"unknown contender {name!r}: ours:auto, ours:train, "
                         "ours:<workers>/<transport>/<server>/<chunking>[@opt=value,...], "
                         f"ours:ray[@address=HOST:PORT], {', '.join(LOOPS)} (each may end in +lstm[N] or +gru[N])")


def _run_gym(kind: str, workload: dict[str, Any], num_envs: int, warmup: float, seconds: float) -> dict[str, Any]:
    import gymnasium as gym

    from components.envs import probe_env_spec

    factory = env_factory(workload)
    engine = workload_engine(workload, probe_env_spec(factory))
    if kind == "gym_sync":
        venv = gym.vector.SyncVectorEnv([factory] * num_envs)
    else:
        venv = gym.vector.AsyncVectorEnv([factory] * num_envs, shared_memory=True, context="spawn")
    try:
        state = {"obs": venv.reset(seed=0)[0]}
        modes = np.zeros(num_envs, np.int8)
        policy = LoopPolicy(engine, num_envs)

        def step() -> int:
            obs, _, terminated, truncated, _ = venv.step(policy(state["obs"], modes))
            state["obs"] = obs
            policy.ended(terminated | truncated)  # throughput is measured: the state restarts a step before the reset
            return num_envs

        frames, elapsed = timed(step, warmup, seconds)
    finally:
        venv.close()
    return {"frames": frames, "seconds": elapsed, "engine": engine.name}


class _TorchRLEnvFactory:
    """A picklable torchrl env factory wrapping our gymnasium factory."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory

    def __call__(self) -> Any:
        from torchrl.envs import GymWrapper

        return GymWrapper(self.factory())


class _TorchRLPolicyFactory:
    """Builds the same network as a TensorDict policy, inside any process."""

    def __init__(self, workload: dict[str, Any], env_spec: Any) -> None:
        self.workload, self.env_spec = workload, env_spec

    def __call__(self) -> Any:
        import torch
        from tensordict.nn import TensorDictModule

        model = model_spec(self.workload).build(self.env_spec).eval()

        class Act(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, ...]:
                batched = observation.dim() == len(self.model.spec.obs_shape) + 1
                obs = observation if batched else observation.unsqueeze(0)
                out = self.model.act({"observation": obs})
                if not batched:
                    out = {k: v.squeeze(0) for k, v in out.items()}
                return out["action"], out["sample_log_prob"], out["state_value"]

        return TensorDictModule(Act(), in_keys=["observation"], out_keys=["action", "sample_log_prob", "state_value"])


def _run_torchrl(kind: str, workload: dict[str, Any], num_envs: int, warmup: float, seconds: float) -> dict[str, Any]:
    import torch  # noqa: F401
    from torchrl.collectors import AsyncBatchedCollector
    from torchrl.modules.inference_server import InferenceServerConfig

    from components.envs import probe_env_spec

    factory = env_factory(workload)
    env_spec = probe_env_spec(factory)
    collector = AsyncBatchedCollector(
        create_env_fn=[_TorchRLEnvFactory(factory)] * num_envs,
        policy_factory=_TorchRLPolicyFactory(workload, env_spec),
        frames_per_batch=int(workload["frames_per_batch"]),
        total_frames=-1,
        env_backend="multiprocessing",
        transport="auto" if kind == "torchrl_auto" else "driver",
        server_config=InferenceServerConfig(max_batch_size=num_envs, min_batch_size=1, timeout=0.002),
    )
    try:
        iterator = iter(collector)

        def step() -> int:
            return next(iterator).numel()

        frames, elapsed = timed(step, warmup, seconds)
        backend = getattr(collector, "server_backend", "?")
        iterator.close()
    finally:
        collector.shutdown()
    return {"frames": frames, "seconds": elapsed, "server_backend": backend}


def measure_limit(workload: dict[str, Any], num_envs: int) -> dict[str, Any]:
    """The costs the limit and the layout predictions are computed from (:func:`pipeline.plan.layout.measure`)."""
    from components.envs import probe_env_spec
    from pipeline.plan.probes import measure

    factory = env_factory(workload)
    spec = probe_env_spec(factory)
    engine = workload_engine(workload, spec, str(workload.get("device", "cpu")))
    costs = measure(factory, engine, spec, CPUS, budget_s=1.0)
    return {"costs": costs.as_dict(), "env_step_s": costs.env_wall_s, "env_cpu_s": costs.env_cpu_s,
            "inference_per_sample_s": costs.infer_s, "cpus": CPUS, "engine": engine.name}


def trial_main(spec: dict[str, Any], conn: Any) -> None:
    """Entry point of one trial process: run the contender, send back a result dict."""
    from components.threads import pin_pools, report_pools

    pin_pools(TRIAL_THREADS)
    report_pools("bench-trial")
    try:
        # ``<contender>+lstm[N]``: the same contender with the workload's model given a recurrent core
        name, workload = recurrent_variant(spec["contender"], spec["workload"])
        if name == "limit":
            result = measure_limit(workload, spec["num_envs"])
        elif name.startswith("ours:"):
            result = run_ours(name, workload, spec["num_envs"], spec["warmup"], spec["seconds"])
        elif name == "bare_procs":
            from pipeline.bench.bare import run_bare

            result = run_bare(workload, spec["num_envs"], spec["warmup"], spec["seconds"], CPUS)
        elif name.startswith("gym_"):
            result = _run_gym(name, workload, spec["num_envs"], spec["warmup"], spec["seconds"])
        elif name.startswith("torchrl_"):
            result = _run_torchrl(name, workload, spec["num_envs"], spec["warmup"], spec["seconds"])
        else:
            raise ValueError(f"unknown contender {name!r}")
        conn.send({"ok": True, **result})
    except BaseException as exc:  # noqa: BLE001 - reported to the harness
        conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]})
    finally:
        conn.close()
