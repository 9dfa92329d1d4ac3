"""Both collectors give the runner the same surface: the Collector protocol."""

from __future__ import annotations

import inspect

import pytest

from components.collector.collector import AsyncBatchedCollector
from components.collector.protocol import Collector
from components.ray.collector import RayCollector

MEMBERS = [name for name in dir(Collector) if not name.startswith("_") or name == "__iter__"]


@pytest.mark.parametrize("cls", [AsyncBatchedCollector, RayCollector])
def test_every_collector_has_every_member_of_the_protocol_with_its_signature(cls):
    assert {"next_batch", "update_policy_weights_", "pause", "server_stats", "worker_stats", "policy_version",
            "shutdown", "__iter__"} <= set(MEMBERS)
    for name in MEMBERS:
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        wanted = getattr(Collector, name)
        if inspect.isfunction(wanted):
            got = inspect.signature(getattr(cls, name))
            assert list(got.parameters) == list(inspect.signature(wanted).parameters), (cls.__name__, name, got)
        else:
            assert isinstance(inspect.getattr_static(cls, name), property), (cls.__name__, name)


def test_a_built_collector_is_a_collector_and_the_runner_types_it_so():
    from pipeline.runner.collection import build_collector

    assert inspect.signature(build_collector).return_annotation in (Collector, "Collector")
