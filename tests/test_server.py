"""The inference server: batching rules, statistics, weights, errors, shutdown."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from components.inference.server import InferenceServer, ServerConfig
from components.inference.thread_transport import ThreadTransport
from components.inference.transport import RemotePolicyError, ServerStoppedError
from tests.fakes import RecordingModel


def _obs(value: float, rows: int = 2) -> dict[str, torch.Tensor]:
    return {"observation": torch.full((rows, 3), value)}


def test_a_batch_takes_whole_requests_up_to_max_batch_size():
    model, transport = RecordingModel(), ThreadTransport()
    client = transport.client()
    futures = [client.submit(_obs(i), 0) for i in range(10)]  # queued before the server starts
    with InferenceServer(model, transport, ServerConfig(max_batch_size=8)) as server:
        results = [f.result(timeout=10) for f in futures]
        stats = server.stats()
    assert model.batch_sizes == [8, 8, 4]
    assert [int(r["action"][0]) for r in results] == [30 * i for i in range(10)]
    assert stats["requests"] == 10 and stats["batches"] == 3 and stats["rows"] == 20
    assert stats["avg_batch_size"] == pytest.approx(20 / 3)


def test_a_request_larger_than_max_batch_size_is_served_in_slices():
    model, transport = RecordingModel(), ThreadTransport()
    with InferenceServer(model, transport, ServerConfig(max_batch_size=4)) as server:
        out = transport.client().submit({"observation": torch.arange(10.0).repeat_interleave(3).reshape(10, 3) / 3}, 0)
        actions = out.result(timeout=10)["action"].tolist()
        stats = server.stats()
    assert model.batch_sizes == [4, 4, 2]
    assert actions == [10 * i for i in range(10)]
    assert stats["batches"] == 3 and stats["requests"] == 1 and stats["rows"] == 10


def test_min_batch_size_waits_up_to_timeout_then_serves_what_it_has():
    model, transport = RecordingModel(), ThreadTransport()
    client = transport.client()
    with InferenceServer(model, transport, ServerConfig(min_batch_size=6, timeout=0.3)):
        started = time.monotonic()
        client.submit(_obs(1), 0).result(timeout=10)
        waited = time.monotonic() - started
        assert model.batch_sizes == [2]
        assert 0.25 <= waited < 5.0, "a lone request waits for company up to the timeout"
        first = client.submit(_obs(1), 0)
        time.sleep(0.05)
        second = client.submit(_obs(2, rows=4), 0)
        first.result(timeout=10), second.result(timeout=10)
    assert model.batch_sizes[1:] == [6], "requests arriving within the timeout share one batch"


def test_stats_report_forward_time_and_queue_latency_of_a_known_workload():
    model, transport = RecordingModel(delay=0.02), ThreadTransport()
    client = transport.client()
    queued = [client.submit(_obs(i, rows=4), 0) for i in range(3)]
    time.sleep(0.1)  # these three waited >= 100 ms before the server started
    with InferenceServer(model, transport, ServerConfig(max_batch_size=4)) as server:
        for f in queued:
            f.result(timeout=10)
        for i in range(5):
            client.submit(_obs(i, rows=4), 0).result(timeout=10)
        stats = server.stats(reset=True)
        assert server.stats()["batches"] == 0, "reset empties the window"
    assert stats["requests"] == 8 and stats["batches"] == 8 and stats["avg_batch_size"] == 4
    assert 20 <= stats["forward_p50_ms"] < 200
    assert stats["queue_latency_p95_ms"] >= 100
    assert stats["requests_per_s"] < 1000 / 20 + 1, "8 forwards of >= 20 ms cannot run faster"


def test_weight_update_bumps_version_and_changes_actions():
    model, transport = RecordingModel(), ThreadTransport()
    client = transport.client()
    with InferenceServer(model, transport) as server:
        before = client.submit(_obs(1), 0).result(timeout=10)
        assert server.update_weights({"scale": torch.tensor(2.0)}) == 1
        after = client.submit(_obs(1), 0).result(timeout=10)
    assert before["policy_version"].tolist() == [0, 0] and after["policy_version"].tolist() == [1, 1]
    assert int(after["action"][0]) == 2 * int(before["action"][0])


def test_a_model_error_reaches_only_the_request_that_caused_it():
    model, transport = RecordingModel(), ThreadTransport()
    client = transport.client()
    good = client.submit(_obs(1), 0)
    bad = client.submit(_obs(float("nan")), 0)
    also_good = client.submit(_obs(2), 0)
    with InferenceServer(model, transport):
        with pytest.raises(RemotePolicyError, match="NaN"):
            bad.result(timeout=10)
        assert int(good.result(timeout=10)["action"][0]) == 30
        assert int(also_good.result(timeout=10)["action"][0]) == 60


def test_shutdown_fails_pending_requests_instead_of_hanging():
    gate = threading.Event()
    model, transport = RecordingModel(gate=gate), ThreadTransport()
    client = transport.client()
    server = InferenceServer(model, transport).start()
    in_forward = client.submit(_obs(1), 0)
    time.sleep(0.1)
    queued = client.submit(_obs(2), 0)
    stopper = threading.Thread(target=server.shutdown, name="test-stopper")
    stopper.start()
    gate.set()
    stopper.join(10)
    assert not server.is_alive
    in_forward.result(timeout=10)  # the batch in flight completes
    with pytest.raises(ServerStoppedError):
        queued.result(timeout=10)
    with pytest.raises(ServerStoppedError):
        client.submit(_obs(3), 0)
