"""PolicyClient: a remote policy that looks like a local TensorDict policy."""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict

from components.envs import EnvSpec
from components.inference.client import PolicyClient
from components.inference.loop import ServerConfig
from components.inference.server import InferenceServer
from components.inference.slots import SlotTransport
from components.inference.transport import Layout
from components.interaction import InteractionMode
from components.models import ModelSpec
from components.shm import FieldSpec
from tests.fakes import RecordingModel

LAYOUT = Layout((FieldSpec("observation", (2,), "float32"),),
                (FieldSpec("action", (), "int64"), FieldSpec("policy_version", (), "int64")))
SPEC = EnvSpec((2,), "float32", "discrete", action_n=2)
FAKE = ModelSpec("tests.fakes.make_recording_model")


def _server(transport: SlotTransport, **config) -> InferenceServer:
    return InferenceServer(FAKE, transport, ServerConfig(**config), env_spec=SPEC,
                           template=RecordingModel().state_dict())


def test_calling_the_client_looks_like_a_local_tensordict_policy():
    transport = SlotTransport(LAYOUT, num_slots=1, rows_per_slot=3, ctx=threading)
    policy = PolicyClient(transport.client())
    with _server(transport):
        out = policy(TensorDict({"observation": torch.ones(3, 2)}, batch_size=[3]))
    assert isinstance(out, TensorDict) and out.batch_size == torch.Size([3])
    assert out["action"].tolist() == [20, 20, 20] and out["policy_version"].tolist() == [0, 0, 0]


def test_more_submits_than_slots_collect_the_oldest_first_and_keep_every_answer():
    transport = SlotTransport(LAYOUT, num_slots=2, rows_per_slot=1, ctx=threading)
    policy = PolicyClient([transport.client(), transport.client()])
    assert policy.max_inflight == 2
    with _server(transport):
        futures = [policy.submit(TensorDict({"observation": torch.full((1, 2), float(i))}, [1])) for i in range(5)]
        actions = [f.result(timeout=10)["action"].tolist() for f in futures]
    assert actions == [[20 * i] for i in range(5)], "each future keeps its own answer although slots were reused"


def test_each_request_carries_its_own_interaction_mode_in_a_shared_batch():
    transport = SlotTransport(LAYOUT, num_slots=3, rows_per_slot=2, ctx=threading)
    explore = PolicyClient([transport.client(), transport.client()], interaction_mode="random")
    greedy = PolicyClient(transport.client(), interaction_mode=InteractionMode.DETERMINISTIC)
    td = TensorDict({"observation": torch.zeros(2, 2)}, batch_size=[2])
    futures = [explore.submit(td), greedy.submit(td), explore.submit(td, interaction_mode="mode")]
    with _server(transport, max_batch_size=8) as server:
        modes = [f.result(timeout=10)["action"].tolist() for f in futures]
        stats = server.stats()
    assert stats["batches"] == 1 and stats["rows"] == 6, "all three requests were served by one forward"
    assert modes == [[0, 0], [3, 3], [1, 1]]


def test_unknown_interaction_mode_is_a_clear_error():
    transport = SlotTransport(LAYOUT, num_slots=1, rows_per_slot=1, ctx=threading)
    with pytest.raises(ValueError, match="allowed: random"):
        PolicyClient(transport.client(), interaction_mode="greedy-ish")
