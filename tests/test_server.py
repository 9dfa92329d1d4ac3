"""The inference server contract, the same in every placement.

Server in a thread or a process x clients in threads (the test's own thread)
or in spawned processes: batching by min/max/timeout, errors delivered to the
requester that caused them, death detected by waiting clients within 2 s,
versioned weights, identical statistics keys, a start failure as one error.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from components.envs import EnvSpec
from components.inference.loop import ServerConfig
from components.inference.server import InferenceServer, ServerError
from components.inference.slots import SlotTransport
from components.inference.stats import STAT_KEYS
from components.inference.transport import Layout, RemotePolicyError, ServerDiedError
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
SERVERS = ["thread", "process"]


def _transport(placement: str, clients: str, slots: int, rows: int = 2) -> SlotTransport:
    ctx = CTX if "process" in (placement, clients) else threading
    return SlotTransport(LAYOUT, num_slots=slots, rows_per_slot=rows, ctx=ctx)


def _server(transport: SlotTransport, placement: str, delay: float = 0.0, **config) -> InferenceServer:
    return InferenceServer(ModelSpec("tests.fakes.make_recording_model", {"delay": delay}), transport,
                           ServerConfig(**config), env_spec=SPEC, placement=placement, ctx=CTX,
                           template=RecordingModel().state_dict())


def _ask(client, value: float, rows: int | None = None) -> None:  # noqa: ANN001
    client.request["observation"][:] = value
    client.submit(rows)


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


@pytest.mark.parametrize("placement", SERVERS)
def test_a_batch_takes_whole_requests_up_to_max_batch_size(placement):
    transport = _transport(placement, "thread", slots=10)
    clients = [transport.client() for _ in range(10)]
    for i, client in enumerate(clients):  # all queued before the server starts
        _ask(client, i)
    with _server(transport, placement, max_batch_size=8) as server:
        actions = [int(c.wait(timeout=20)["action"][0]) for c in clients]
        stats = server.stats()
    assert actions == [30 * i for i in range(10)]
    assert (stats["requests"], stats["batches"], stats["rows"]) == (10, 3, 20), "8 + 8 + 4 rows"


@pytest.mark.parametrize("placement", SERVERS)
def test_a_request_larger_than_max_batch_size_is_served_in_slices(placement):
    transport = _transport(placement, "thread", slots=1, rows=10)
    client = transport.client()
    client.request["observation"][:] = (np.arange(10.0).repeat(3).reshape(10, 3) / 3).astype(np.float32)
    client.submit()
    with _server(transport, placement, max_batch_size=4) as server:
        actions = client.wait(timeout=20)["action"].tolist()
        stats = server.stats()
    assert actions == [10 * i for i in range(10)]
    assert (stats["batches"], stats["requests"], stats["rows"]) == (3, 1, 10)


@pytest.mark.parametrize("placement", SERVERS)
def test_min_batch_size_waits_up_to_timeout_then_serves_what_it_has(placement):
    transport = _transport(placement, "thread", slots=2, rows=4)
    first, second = transport.client(), transport.client()
    with _server(transport, placement, min_batch_size=6, timeout=0.3) as server:
        started = time.monotonic()
        _ask(first, 1, rows=2)
        first.wait(timeout=20)
        assert time.monotonic() - started >= 0.25, "a lone request waits for company up to the timeout"
        server.stats()
        _ask(first, 1, rows=2)
        time.sleep(0.05)
        _ask(second, 2, rows=4)
        first.wait(timeout=20), second.wait(timeout=20)
        stats = server.stats()
    assert (stats["batches"], stats["rows"]) == (1, 6), "requests arriving within the timeout share one batch"


@pytest.mark.parametrize("clients", ["thread", "process"])
@pytest.mark.parametrize("placement", SERVERS)
def test_many_clients_round_trip_and_the_stats_count_every_row(placement, clients, spawn):
    transport = _transport(placement, clients, slots=4)
    handles = [transport.client() for _ in range(4)]
    with _server(transport, placement, max_batch_size=8) as server:
        if clients == "process":
            procs = [spawn(children.round_trips, c, 100.0 * i, 60) for i, c in enumerate(handles)]
            for p in procs:
                p.join(60)
            assert [p.exitcode for p in procs] == [0, 0, 0, 0]
        else:
            errors: list = []
            threads = [threading.Thread(target=lambda c=c, i=i: _collect(errors, children.round_trips, c, 100.0 * i, 60),
                                        name=f"test-client-{i}") for i, c in enumerate(handles)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors and not any(t.is_alive() for t in threads), errors
        stats = server.stats()
    assert stats["requests"] == 240 and stats["rows"] == 480 and stats["rows_total"] == 480


def _collect(errors: list, fn, *args) -> None:  # noqa: ANN001
    try:
        fn(*args)
    except BaseException as err:  # noqa: BLE001 - reported by the test thread
        errors.append(err)


@pytest.mark.parametrize("clients", ["thread", "process"])
@pytest.mark.parametrize("placement", SERVERS)
def test_a_model_error_reaches_only_the_request_that_caused_it(placement, clients, spawn):
    transport = _transport(placement, clients, slots=3)
    handles = [transport.client() for _ in range(3)]
    # min_batch_size 6: the three requests share one failing batch
    with _server(transport, placement, min_batch_size=6, timeout=2.0):
        if clients == "process":
            procs = [spawn(children.one_request, c, v) for c, v in zip(handles, (1.0, float("nan"), 2.0))]
            for p in procs:
                p.join(60)
            assert [p.exitcode for p in procs] == [0, 4, 0]
        else:
            for c, v in zip(handles, (1.0, float("nan"), 2.0)):
                _ask(c, v)
            assert handles[0].wait(timeout=20)["action"].tolist() == [30, 30]
            with pytest.raises(RemotePolicyError, match="NaN"):
                handles[1].wait(timeout=20)
            assert handles[2].wait(timeout=20)["action"].tolist() == [60, 60]


# A thread cannot be killed from outside: its death is the fatal fault.
@pytest.mark.parametrize(("placement", "how"), [("thread", "fatal fault"), ("process", "fatal fault"),
                                                ("process", "SIGKILL")])
def test_a_dead_server_fails_waiting_clients_within_two_seconds(placement, how):
    transport = _transport(placement, "thread", slots=2)
    victim, bystander = transport.client(), transport.client()
    # min_batch_size 4: the bystander's request waits for the victim's and shares its batch
    server = _server(transport, placement, delay=0.5 if how == "SIGKILL" else 0.0,
                     min_batch_size=4 if how == "fatal fault" else 1, timeout=5.0).start()
    try:
        _ask(bystander, 1.0)
        if how == "SIGKILL":
            time.sleep(0.2)  # the server is now inside its forward
            os.kill(server._runner.pid, signal.SIGKILL)
        else:
            _ask(victim, -999.0)
        died = time.monotonic()
        with pytest.raises(ServerDiedError, match="exited"):
            bystander.wait(timeout=30)
        assert time.monotonic() - died < 2.0
        deadline = time.monotonic() + 5
        while server.is_alive and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not server.is_alive
        if how == "fatal fault":
            assert "fatal fault" in server.error
        with pytest.raises(ServerDiedError):
            _ask(bystander, 1.0)
    finally:
        server.shutdown()


@pytest.mark.parametrize("placement", SERVERS)
def test_weights_carry_the_version_they_were_published_with(placement):
    transport = _transport(placement, "thread", slots=1)
    client = transport.client()
    server = _server(transport, placement)
    assert server.update_weights({"scale": torch.tensor(2.0)}, version=0) == 0, "initial weights are version 0"
    with server:
        _ask(client, 1.0)
        first = {k: v.copy() for k, v in client.wait(timeout=20).items()}
        assert first["policy_version"].tolist() == [0, 0] and first["action"].tolist() == [60, 60]
        assert server.update_weights({"scale": torch.tensor(3.0)}, version=5) == 5
        deadline, out = time.monotonic() + 10, first
        while int(out["policy_version"][0]) != 5 and time.monotonic() < deadline:
            _ask(client, 1.0)
            out = client.wait(timeout=20)
        assert out["policy_version"].tolist() == [5, 5] and out["action"].tolist() == [90, 90]
        assert server.policy_version == 5 and server.update_weights({"scale": torch.tensor(1.0)}) == 6
        stats = server.stats()
    assert stats["weight_updates_total"] >= 2 and stats["policy_version"] in (5, 6)


def test_thread_and_process_servers_report_the_same_statistics_keys():
    keys = {}
    for placement in SERVERS:
        transport = _transport(placement, "thread", slots=1)
        client = transport.client()
        with _server(transport, placement) as server:
            _ask(client, 1.0)
            client.wait(timeout=20)
            keys[placement] = tuple(server.stats())
            idle = server.stats()
        assert idle["rows"] == 0 and np.isnan(idle["avg_batch_size"]), "an idle interval: zero rows, no average"
    assert keys["thread"] == keys["process"] == STAT_KEYS


@pytest.mark.parametrize("placement", SERVERS)
def test_a_stats_request_that_timed_out_does_not_answer_the_next_one(placement):
    transport = _transport(placement, "thread", slots=1)
    client = transport.client()
    with _server(transport, placement) as server:
        server.stats(timeout=0.0)  # gives up at once; its reply arrives late
        time.sleep(0.5)
        for _ in range(3):
            _ask(client, 1.0)
            client.wait(timeout=20)
        stats = server.stats()
    assert stats["rows"] == 6, "the reply belongs to this request, not to the abandoned one"


@pytest.mark.parametrize("placement", SERVERS)
def test_a_server_that_cannot_start_is_one_error_naming_why(placement):
    transport = _transport(placement, "thread", slots=1)
    server = InferenceServer(ModelSpec("tests.fakes.no_such_model"), transport, env_spec=SPEC, placement=placement,
                             ctx=CTX, template=RecordingModel().state_dict())
    with pytest.raises(ServerError, match=rf"inference server \({placement}\) failed to start: .*no_such_model"):
        server.start(timeout=60)
    assert not server.is_alive
    server.shutdown()
