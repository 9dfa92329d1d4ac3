"""The config reference is generated and current; every schema key is read by some code."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pipeline.plan.docs import _resolve, render
from pipeline.plan.schema import Config, DQNSchema, PPOSchema, ReplaySchema
from tests.conftest import ROOT


def test_the_committed_config_reference_is_what_the_schemas_say():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == render(), "docs/config.md is stale: python -m pipeline.plan.docs > docs/config.md"


def _schemas() -> list[tuple[str, type]]:
    out = [("", Config), ("replay", ReplaySchema), ("trainer", PPOSchema), ("trainer", DQNSchema)]
    out += [(f.name, _resolve(f)) for f in dataclasses.fields(Config) if dataclasses.is_dataclass(_resolve(f))]
    return out


def _code() -> str:
    skip = {ROOT / "pipeline" / "schema.py", ROOT / "pipeline" / "plan" / "docs.py"}
    files = [p for d in ("pipeline", "components") for p in (ROOT / d).rglob("*.py")
             if p not in skip and "bench" not in p.parts]
    return "\n".join(p.read_text() for p in files)


@pytest.mark.parametrize("group,cls", _schemas(), ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_every_key_of_a_schema_is_read_by_the_code_that_runs(group, cls):
    code = _code()
    has_target = any(f.name == "_target_" for f in dataclasses.fields(cls))
    unread = [f.name for f in dataclasses.fields(cls)
              if f.name != "_target_" and not dataclasses.is_dataclass(_resolve(f))
              and not re.search(rf"(\.|\[[\"']|\bget\([\"']|[\"']){re.escape(f.name)}\b", code)
              # a keyword of the class a _target_ node builds (Hydra passes the keys as arguments)
              and not (has_target and re.search(rf"\b{re.escape(f.name)}: [^=\n]+=", code))]
    assert not unread, f"{group or 'top-level'} keys no code reads (dead words): {unread}"
