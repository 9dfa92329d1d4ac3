"""CUDA paths: pinned staging, CUDA-graph replay, CUDA-IPC weights, a GPU run.

Skipped where no CUDA device is present (the skip reason says so); they run
wherever one is.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from components.collector.collector import AsyncBatchedCollector, GraphSpec
from components.envs import EnvSpec, GymEnvFactory
from components.inference.loop import ServerConfig
from components.inference.server import InferenceServer
from components.inference.slots import SlotTransport
from components.inference.transport import derive_layout
from components.models import ActorCritic, ModelSpec
from components.inference.serving import TorchEngine
from tests.conftest import run_pipeline

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPEC = EnvSpec((4,), "float32", "discrete", action_n=2)


def _greedy(n: int) -> np.ndarray:
    return np.full(n, 3, np.int8)  # DETERMINISTIC: comparable across devices


def test_cuda_engine_stages_through_pinned_memory_and_matches_the_cpu_policy():
    model = ActorCritic(SPEC).eval()
    engine = TorchEngine(model.to("cuda"), "cuda", "cpu")
    obs = np.random.default_rng(0).normal(size=(37, 4)).astype(np.float32)
    out = engine.act({"observation": obs}, _greedy(37))
    assert all(v.device.type == "cpu" and v.is_pinned() for v in out.values())
    cpu = ActorCritic(SPEC).eval()
    cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    with torch.no_grad():
        ref = cpu.act({"observation": torch.from_numpy(obs)}, torch.from_numpy(_greedy(37)))
    assert torch.equal(out["action"], ref["action"])
    assert torch.allclose(out["state_value"], ref["state_value"], atol=1e-4)


def test_static_batch_size_replays_a_cuda_graph_with_padding():
    model = ActorCritic(SPEC).eval().to("cuda")
    eager = TorchEngine(model, "cuda", "cpu")
    graphed = TorchEngine(model, "cuda", "cpu", static_batch_size=64)
    for rows in (5, 64, 17):
        obs = np.random.default_rng(rows).normal(size=(rows, 4)).astype(np.float32)
        a, b = eager.act({"observation": obs}, _greedy(rows)), graphed.act({"observation": obs}, _greedy(rows))
        assert torch.equal(a["action"], b["action"]) and torch.allclose(a["state_value"], b["state_value"], atol=1e-5)
    assert graphed._graph is not None
    with torch.no_grad():  # weights copied in place are seen by the captured graph
        for p in model.parameters():
            p.zero_()
    obs = np.ones((8, 4), np.float32)
    assert torch.allclose(graphed.act({"observation": obs}, _greedy(8))["state_value"], torch.zeros(8))


@pytest.mark.parametrize("placement", ["thread", "process"])
def test_a_server_on_cuda_in_either_placement_receives_weights_and_their_version(placement):
    ctx = mp.get_context("spawn")
    model = ActorCritic(SPEC)
    transport = SlotTransport(derive_layout(model, SPEC.observation_field()), num_slots=1, rows_per_slot=4, ctx=ctx)
    client = transport.client()
    server = InferenceServer(ModelSpec("components.models.ActorCritic"), transport, ServerConfig(device="cuda"),
                             env_spec=SPEC, placement=placement, template=model.state_dict(), ctx=ctx).start()
    try:
        trained = ActorCritic(SPEC).to("cuda")
        with torch.no_grad():
            for p in trained.parameters():
                p.zero_()
        assert server.update_weights(trained, version=3) == 3
        client.request["observation"][:] = 1.0
        for _ in range(50):
            client.submit()
            out = client.wait(timeout=30)
            if int(out["policy_version"][0]) == 3:
                break
        assert int(out["policy_version"][0]) == 3
        assert np.allclose(out["state_value"], 0.0)
    finally:
        server.shutdown()


@pytest.mark.parametrize(("workers", "server"), [("thread", "thread"), ("thread", "process"), ("process", "thread"),
                                                 ("process", "process")])
def test_collector_serves_the_policy_on_cuda_in_every_placement(workers, server):
    graph = GraphSpec(workers, server, num_envs=4, envs_per_worker=2, chunk_len=4)
    collector = AsyncBatchedCollector(GymEnvFactory("CartPole-v1"), ModelSpec("components.models.ActorCritic"), graph,
                                      frames_per_batch=64, total_frames=256, server_config=ServerConfig(device="cuda"))
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert sum(b.numel() for b in batches) == 256


def test_a_run_with_device_cuda_trains_on_the_gpu(tmp_path):
    result = run_pipeline(["device=cuda", "workers=process", "transport=auto", "trainer.total_frames=2048",
                           "logger=jsonl", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "policy cuda" in result.stdout
