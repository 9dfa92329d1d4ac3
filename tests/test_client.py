"""PolicyClient: futures, the in-flight bound, interaction modes per request."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict

from components.inference.client import PolicyClient
from components.inference.server import InferenceServer, ServerConfig
from components.inference.thread_transport import ThreadTransport
from components.interaction import InteractionMode
from tests.fakes import RecordingModel


def test_calling_the_client_looks_like_a_local_tensordict_policy():
    transport = ThreadTransport()
    with InferenceServer(RecordingModel(), transport):
        policy = PolicyClient(transport.client())
        out = policy(TensorDict({"observation": torch.ones(3, 2)}, batch_size=[3]))
    assert isinstance(out, TensorDict) and out.batch_size == torch.Size([3])
    assert out["action"].tolist() == [20, 20, 20] and out["policy_version"].tolist() == [0, 0, 0]


def test_max_inflight_blocks_the_next_submit_until_a_request_completes():
    gate = threading.Event()
    transport = ThreadTransport()
    with InferenceServer(RecordingModel(gate=gate), transport):
        policy = PolicyClient(transport.client(), max_inflight=2)
        td = TensorDict({"observation": torch.ones(1, 2)}, batch_size=[1])
        first, second = policy.submit(td), policy.submit(td)
        third: list = []
        submitter = threading.Thread(target=lambda: third.append(policy.submit(td)), name="test-submitter")
        submitter.start()
        time.sleep(0.3)
        assert not third, "a third request must wait while two are in flight"
        with pytest.raises(TimeoutError):
            first.result(timeout=0.05)  # a timed-out wait keeps the permit
        time.sleep(0.2)
        assert not third
        gate.set()
        submitter.join(10)
        assert third and third[0].result(timeout=10)["action"].tolist() == [20]
        first.result(timeout=10), second.result(timeout=10)


def test_each_request_carries_its_own_interaction_mode_in_a_shared_batch():
    transport = ThreadTransport()
    explore = PolicyClient(transport.client(), interaction_mode="random")
    greedy = PolicyClient(transport.client(), interaction_mode=InteractionMode.DETERMINISTIC)
    td = TensorDict({"observation": torch.zeros(2, 2)}, batch_size=[2])
    futures = [explore.submit(td), greedy.submit(td), explore.submit(td, interaction_mode="mode")]
    model = RecordingModel()
    with InferenceServer(model, transport, ServerConfig(max_batch_size=8)):
        modes = [f.result(timeout=10)["action"].tolist() for f in futures]
    assert model.batch_sizes == [6], "all three requests were served by one forward"
    assert modes == [[0, 0], [3, 3], [1, 1]]


def test_unknown_interaction_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="allowed: random"):
        PolicyClient(ThreadTransport().client(), interaction_mode="greedy-ish")
