"""The benchmark's contenders, each measured in a fresh process by :func:`trial_main`.

Every contender collects from the same env factory with the same policy
(the same network, executed by the same serving engine), steps for a
warm-up that is not timed, then counts frames for ``seconds``:

* ``ours:<workers>/<transport>/<server>/<chunking>``: this project's collector;
  the consumer only takes batches (no training). ``ours:auto`` runs the
  layout ``transport=auto`` picks for the workload (probed and predicted
  in the trial, see :mod:`pipeline.layout`).
* ``ours:ray``: env hosts on a Ray cluster started in the trial (127.0.0.1,
  one host per CPU, :mod:`components.ray`), chunks through the object store;
  set against the local process layout it is the cost of going through Ray.
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

import math
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
#: BLAS/OpenMP/torch threads of every trial process and of what it starts (gymnasium's and TorchRL's
#: workers, the bare loops inherit them), as ``python -m pipeline`` gives its driver by default
#: (``torch_threads``): every contender runs its policy the same way.
TRIAL_THREADS = 1


def _factory(workload: dict[str, Any]) -> Callable[[], Any]:
    from hydra.utils import instantiate

    return instantiate(workload["env"], _convert_="all")


def _model_spec(workload: dict[str, Any]) -> Any:
    from components.models import ModelSpec

    kwargs = dict(workload["model"])
    return ModelSpec(kwargs.pop("_target_"), kwargs)


def _timed(step: Callable[[], int], warmup: float, seconds: float) -> tuple[int, float]:
    """Run ``step`` (returns frames) for ``warmup`` s untimed, then ``seconds`` s timed."""
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        step()
    frames, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        frames += step()
    return frames, time.perf_counter() - start


_OPTIONS = {"epw": "envs_per_worker", "splits": "splits", "minb": "server_min_batch_size",
            "timeout": "server_timeout", "threads": "server_threads", "nice": "nice", "graph": "static_batch_size",
            "conc": "concurrent_envs"}


def parse_ours(name: str, workload: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """``ours:w/t/s/chunking[@epw=4,splits=2,minb=8,timeout=0.001,threads=2,graph=16,conc=1]``.

    ``graph=N`` (CUDA) pads batches to N rows and replays a captured CUDA graph;
    ``conc=1`` steps each worker's envs concurrently, one thread each.

    The optional ``@`` part overrides workload settings for this contender
    only, so variants can be compared within one alternating run.
    """
    body, _, options = name.split(":", 1)[1].partition("@")
    settings = dict(workload)
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        settings[_OPTIONS[key]] = float(value) if key == "timeout" else int(value)
    return body.split("/"), settings


def chunk_len_for(workers: str, per_worker: int, num_envs: int, frames_per_batch: int, chunking: str = "auto") -> int:
    """The plan's chunking=auto rule (and ``step``)."""
    from pipeline.plan import AUTO_MIN_TRANSITIONS

    if chunking == "step" or workers == "thread":
        return 1
    return min(max(math.ceil(AUTO_MIN_TRANSITIONS / per_worker), frames_per_batch // num_envs),
               max(1, frames_per_batch // per_worker))


def auto_graph(workload: dict[str, Any], num_envs: int, frames_per_batch: int) -> tuple[Any, Any, Any]:
    """``ours:auto``: the layout ``transport=auto`` picks for this workload, by measurement.

    Returns (GraphSpec, the chosen :class:`~pipeline.layout.Layout` with its
    prediction, the measured :class:`~pipeline.layout.Costs`).
    """
    from components.collector.graph import GraphSpec
    from components.envs import probe_env_spec
    from pipeline.layout import choose
    from pipeline.layout_probes import measure
    from pipeline.plan import worker_threads

    factory = _factory(workload)
    spec = probe_env_spec(factory)
    device = str(workload.get("device", "cpu"))
    costs = measure(factory, _engine(workload, spec, device), spec, CPUS)
    servers = ("inline", "thread", "process") if device == "cpu" else ("process", "thread")
    layout, _ = choose(costs, num_envs, servers=servers)
    graph = GraphSpec(layout.workers, layout.server, num_envs=num_envs, envs_per_worker=layout.envs_per_worker,
                      chunk_len=chunk_len_for(layout.workers, layout.envs_per_worker, num_envs, frames_per_batch),
                      splits=layout.splits, concurrent_envs=layout.concurrent,
                      worker_threads=worker_threads(layout.server, int(workload.get("server_threads") or 1)))
    return graph, layout, costs


def ours_graph(name: str, workload: dict[str, Any], num_envs: int, frames_per_batch: int) -> Any:
    """``ours:workers/slots/server/chunking`` -> a GraphSpec (the plan's rules for auto).

    The transport part is always ``slots`` (the one request/response path;
    the driver relay of earlier versions lost to it in every layout measured).
    """
    from components.collector.graph import GraphSpec
    from pipeline.plan import auto_envs_per_worker, worker_threads

    (workers, transport, server, chunking), workload = parse_ours(name, workload)
    if transport not in ("slots", "none"):
        raise ValueError(f"{name}: the transport part must be 'slots' or 'none' (server inline; got {transport!r})")
    per_worker, _ = auto_envs_per_worker(workload.get("envs_per_worker"), num_envs, workers, CPUS, server)
    concurrent = bool(workload.get("concurrent_envs"))
    splits = 1 if server == "inline" or concurrent else workload.get("splits") or (2 if workers == "process" else 1)
    chunk_len = chunk_len_for(workers, per_worker, num_envs, frames_per_batch, chunking)
    nice = workload.get("nice")
    nice = 0 if nice is None else int(nice)
    return GraphSpec(workers, server, num_envs=num_envs, envs_per_worker=per_worker,
                     chunk_len=chunk_len, splits=int(splits), worker_nice=nice, concurrent_envs=concurrent,
                     worker_threads=worker_threads(server, int(workload.get("server_threads") or 1)))


def _ray_collector(workload: dict[str, Any], num_envs: int, server: Any) -> tuple[Any, Any, dict[str, Any]]:
    """``ours:ray``: a local loopback cluster, one env host per CPU, the runner's auto chunk size."""
    from components.ray.cluster import RayCluster
    from components.ray.collector import RayCollector, RayHostsSpec, auto_chunk_len

    cluster = RayCluster("local", num_cpus=CPUS).connect()
    hosts = max(1, min(num_envs, CPUS))
    spec = RayHostsSpec(num_envs, hosts, auto_chunk_len(num_envs, hosts, int(workload["frames_per_batch"])))
    collector = RayCollector(_factory(workload), _model_spec(workload), spec, cluster,
                             frames_per_batch=int(workload["frames_per_batch"]), total_frames=-1, seed=0,
                             server_config=server)
    graph = {"workers": "ray", "server": "inline", "hosts": hosts, "envs_per_host": spec.rows[0],
             "chunk_len": spec.chunk_len, "in_flight": spec.in_flight}
    return collector, cluster, graph


def _run_ours(name: str, workload: dict[str, Any], num_envs: int, warmup: float, seconds: float) -> dict[str, Any]:
    from components.collector.collector import AsyncBatchedCollector
    from components.inference.loop import ServerConfig

    frames_per_batch = int(workload["frames_per_batch"])
    choice: dict[str, Any] = {}
    if name == "ours:ray":
        server = ServerConfig(max_batch_size=max(num_envs, 1), min_batch_size=1, seed=0, device="cpu")
        collector, cluster, graph_info = _ray_collector(workload, num_envs, server)
        try:
            return _measure(collector, warmup, seconds, graph_info, choice)
        finally:
            cluster.close()
    if name == "ours:auto":
        graph, layout, costs = auto_graph(workload, num_envs, frames_per_batch)
        choice = {"choice": layout.describe(num_envs), "predicted_fps": layout.predicted_fps,
                  "costs": costs.as_dict()}
    else:
        graph = ours_graph(name, workload, num_envs, frames_per_batch)
        _, workload = parse_ours(name, workload)
    device = str(workload.get("device", "cpu"))
    static = workload.get("static_batch_size")
    server = ServerConfig(
        max_batch_size=max(num_envs, 1),
        min_batch_size=min(int(workload.get("server_min_batch_size", 1)), num_envs),
        timeout=float(workload.get("server_timeout", 0.002)),
        num_threads=int(workload.get("server_threads", 1)),
        seed=0,
        device="cpu" if graph.server == "inline" else device,
        static_batch_size=int(static) if static and device.startswith("cuda") else None,
    )
    collector = AsyncBatchedCollector(_factory(workload), _model_spec(workload), graph,
                                      frames_per_batch=frames_per_batch, total_frames=-1, seed=0,
                                      server_config=server)
    return _measure(collector, warmup, seconds, graph.__dict__, choice)


def _measure(collector: Any, warmup: float, seconds: float, graph: dict[str, Any],
             choice: dict[str, Any]) -> dict[str, Any]:
    """Frames a collector delivers in ``seconds`` after ``warmup``, with its statistics; shuts it down."""
    try:
        collector.start()

        def step() -> int:
            return collector.next_batch().numel()

        # The first batch can take seconds (the driver's first tensordict import) while the workers fill
        # every chunk; the warm-up starts after it, so no backlog collected before it is timed.
        step()
        _timed(step, warmup, 0.0)
        collector.server_stats(reset=True)
        collector.worker_stats()
        frames, elapsed = _timed(step, 0.0, seconds)
        stats = collector.server_stats()
        workers = collector.worker_stats()
    finally:
        collector.shutdown()
    return {
        "frames": frames, "seconds": elapsed, "graph": graph, **choice,
        "server_avg_batch_size": stats.get("avg_batch_size"), "server_forward_p50_ms": stats.get("forward_p50_ms"),
        "worker_env_frac": workers.get("env_frac"), "worker_infer_wait_frac": workers.get("infer_wait_frac"),
        "worker_chunk_wait_frac": workers.get("chunk_wait_frac"),
        **{k.replace("/", "_"): v for k, v in workers.items() if k.startswith("ray/") and "node_frames" not in k},
    }


def _engine(workload: dict[str, Any], env_spec: Any, device: str = "cpu") -> Any:
    from components.inference.serving import serving_engine

    model = _model_spec(workload).build(env_spec).to(device).eval()
    return serving_engine(model, "auto", device, seed=0)


def _actions(engine: Any, obs: np.ndarray, modes: np.ndarray) -> np.ndarray:
    action = engine.act({"observation": obs}, modes)["action"]
    return action.numpy() if hasattr(action, "numpy") else action


def _run_gym(kind: str, workload: dict[str, Any], num_envs: int, warmup: float, seconds: float) -> dict[str, Any]:
    import gymnasium as gym

    from components.envs import probe_env_spec

    factory = _factory(workload)
    engine = _engine(workload, probe_env_spec(factory))
    if kind == "gym_sync":
        venv = gym.vector.SyncVectorEnv([factory] * num_envs)
    else:
        venv = gym.vector.AsyncVectorEnv([factory] * num_envs, shared_memory=True, context="spawn")
    try:
        state = {"obs": venv.reset(seed=0)[0]}
        modes = np.zeros(num_envs, np.int8)

        def step() -> int:
            state["obs"] = venv.step(_actions(engine, state["obs"], modes))[0]
            return num_envs

        frames, elapsed = _timed(step, warmup, seconds)
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

        model = _model_spec(self.workload).build(self.env_spec).eval()

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

    factory = _factory(workload)
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

        frames, elapsed = _timed(step, warmup, seconds)
        backend = getattr(collector, "server_backend", "?")
        iterator.close()
    finally:
        collector.shutdown()
    return {"frames": frames, "seconds": elapsed, "server_backend": backend}


def measure_limit(workload: dict[str, Any], num_envs: int) -> dict[str, Any]:
    """The costs the limit and the layout predictions are computed from (:func:`pipeline.layout.measure`)."""
    from components.envs import probe_env_spec
    from pipeline.layout_probes import measure

    factory = _factory(workload)
    spec = probe_env_spec(factory)
    engine = _engine(workload, spec, str(workload.get("device", "cpu")))
    costs = measure(factory, engine, spec, CPUS, budget_s=1.0)
    return {"costs": costs.as_dict(), "env_step_s": costs.env_wall_s, "env_cpu_s": costs.env_cpu_s,
            "inference_per_sample_s": costs.infer_s, "cpus": CPUS, "engine": engine.name}


def trial_main(spec: dict[str, Any], conn: Any) -> None:
    """Entry point of one trial process: run the contender, send back a result dict."""
    from components.threads import pin_pools, report_pools

    pin_pools(TRIAL_THREADS)
    report_pools("bench-trial")
    try:
        name, workload = spec["contender"], spec["workload"]
        if name == "limit":
            result = measure_limit(workload, spec["num_envs"])
        elif name.startswith("ours:"):
            result = _run_ours(name, workload, spec["num_envs"], spec["warmup"], spec["seconds"])
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
