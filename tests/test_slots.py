"""Shared-memory slots between worker processes and a (thread or process) server."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from components.envs import EnvSpec
from components.inference.process_server import ProcessInferenceServer
from components.inference.server import InferenceServer, ServerConfig
from components.inference.slots import SlotTransport
from components.inference.transport import Layout, ServerDiedError
from components.models import ModelSpec
from components.shm import FieldSpec
from tests import children
from tests.fakes import RecordingModel

LAYOUT = Layout(
    (FieldSpec("observation", (3,), "float32"),),
    (FieldSpec("action", (), "int64"), FieldSpec("policy_version", (), "int64")),
)
SPEC = EnvSpec((3,), "float32", "discrete", action_n=2)
CTX = mp.get_context("spawn")


@pytest.fixture
def spawn() -> Iterator:
    started: list = []

    def start(target, *args):  # noqa: ANN001, ANN202
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    yield start
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(5)


def test_many_worker_processes_round_trip_through_their_own_slots(spawn):
    transport = SlotTransport(LAYOUT, num_slots=4, rows_per_slot=2, ctx=CTX)
    clients = [transport.client() for _ in range(4)]
    with InferenceServer(RecordingModel(), transport, ServerConfig(max_batch_size=8)) as server:
        procs = [spawn(children.round_trips, c, 100.0 * i, 60) for i, c in enumerate(clients)]
        for p in procs:
            p.join(60)
        stats = server.stats()
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert stats["requests"] == 240 and stats["rows"] == 480


def test_round_robin_sweep_is_fair_under_load(spawn):
    transport = SlotTransport(LAYOUT, num_slots=6, rows_per_slot=2, ctx=CTX)
    clients = [transport.client() for _ in range(6)]
    counts = CTX.Array("l", 6, lock=False)
    # One slot per batch: the sweep order alone decides who is served.
    with InferenceServer(RecordingModel(delay=0.001), transport, ServerConfig(max_batch_size=2)):
        procs = [spawn(children.hammer, c, 2.0, counts, i) for i, c in enumerate(clients)]
        for p in procs:
            p.join(60)
    served = list(counts)
    assert all(p.exitcode == 0 for p in procs)
    assert min(served) > 0.6 * max(served), f"unfair service: {served}"


def test_a_model_error_is_delivered_to_the_worker_that_asked(spawn):
    transport = SlotTransport(LAYOUT, num_slots=3, rows_per_slot=2, ctx=CTX)
    clients = [transport.client() for _ in range(3)]
    # Wait for all three so they share one failing batch.
    with InferenceServer(RecordingModel(), transport, ServerConfig(min_batch_size=6, timeout=2.0)):
        procs = [spawn(children.one_request, c, v) for c, v in zip(clients, (1.0, float("nan"), 2.0))]
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0, 4, 0]


def _process_server(transport: SlotTransport, delay: float = 0.0) -> ProcessInferenceServer:
    spec = ModelSpec("tests.fakes.make_recording_model", {"delay": delay})
    return ProcessInferenceServer(spec, SPEC, transport, ServerConfig(), template=RecordingModel().state_dict(), ctx=CTX)


def test_process_server_applies_weights_pushed_before_start_then_later_updates():
    transport = SlotTransport(LAYOUT, num_slots=1, rows_per_slot=2, ctx=CTX)
    client = transport.client()
    server = _process_server(transport)
    server.update_weights({"scale": torch.tensor(2.0)})
    server.start()
    try:
        client.request["observation"][:] = 1.0
        client.submit()
        first = {k: v.copy() for k, v in client.wait(timeout=20).items()}
        assert first["policy_version"].tolist() == [1, 1] and first["action"].tolist() == [60, 60]
        server.update_weights({"scale": torch.tensor(3.0)})
        deadline = time.monotonic() + 5
        while server.policy_version != 2 and time.monotonic() < deadline:
            client.submit()
            client.wait(timeout=20)
        client.submit()
        second = client.wait(timeout=20)
        assert server.policy_version == 2
        assert second["policy_version"].tolist() == [2, 2] and second["action"].tolist() == [90, 90]
        assert server.stats()["weight_updates"] == 2
    finally:
        server.shutdown()


def test_a_dead_server_fails_waiting_workers_within_a_second():
    transport = SlotTransport(LAYOUT, num_slots=1, rows_per_slot=2, ctx=CTX)
    client = transport.client()
    server = _process_server(transport, delay=30.0).start()
    try:
        client.request["observation"][:] = 1.0
        client.submit()
        time.sleep(0.3)  # the server is now inside its 30 s forward
        os.kill(server._process.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(ServerDiedError, match="exited"):
            client.wait(timeout=30)
        assert time.monotonic() - killed < 1.5
        with pytest.raises(ServerDiedError):
            client.submit()
    finally:
        server.shutdown()


def test_bad_submissions_are_clear_errors():
    transport = SlotTransport(LAYOUT, num_slots=1, rows_per_slot=2, ctx=CTX)
    client = transport.client()
    with pytest.raises(ValueError, match="CPU tensors only"):
        client.submit_inputs({"observation": torch.zeros(2, 3, device="meta")})
    with pytest.raises(ValueError, match="do not fit"):
        client.submit_inputs({"observation": np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match="row shape"):
        client.submit_inputs({"observation": np.zeros((2, 4), np.float32)})
    client.submit()
    with pytest.raises(RuntimeError, match="in flight"):
        client.submit()
