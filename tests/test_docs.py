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


#: the key whose word names an option (workers=auto says backend: auto even where that is the schema's default)
NAMING_KEYS = {"workers": "backend", "transport": "kind", "server": "backend", "chunking": "mode", "replay": "kind",
               "model": "encoder"}


def test_option_files_state_only_what_differs_from_their_schema():
    """A default restated in an option file drifts from the schema's; the reference (docs/config.md) says it once."""
    import yaml
    from omegaconf import OmegaConf

    from pipeline.plan import schema

    schemas = {"env": schema.EnvSchema, "model": schema.ModelSchema, "workers": schema.WorkersSchema,
               "transport": schema.TransportSchema, "server": schema.ServerSchema, "device": schema.DeviceSchema,
               "chunking": schema.ChunkingSchema, "collector": schema.CollectorSchema, "replay": schema.ReplaySchema,
               "logger": schema.LoggerSchema}
    restated = []
    for group, cls in schemas.items():
        base = OmegaConf.structured(cls)
        files = sorted((ROOT / "conf" / group).glob("*.yaml"))
        assert files, group
        for path in files:
            for key, value in (yaml.safe_load(path.read_text()) or {}).items():
                if key in ("defaults", NAMING_KEYS.get(group)) or key not in base or OmegaConf.is_missing(base, key):
                    continue
                default = base[key]
                default = OmegaConf.to_container(default) if OmegaConf.is_config(default) else \
                    str(default) if hasattr(default, "value") else default
                if default == value:
                    restated.append(f"conf/{group}/{path.name}: {key}: {value!r}")
    assert not restated, restated


def test_the_bring_your_own_example_trains_as_the_page_says(tmp_path):
    """docs/bring-your-own.md's command, as written there: a Dict env with a mask and a model of one's own."""
    import os
    import shlex

    from tests.conftest import run_pipeline

    page = (ROOT / "docs" / "bring-your-own.md").read_text()
    command = re.search(r"```bash\n(.*?)```", page, re.S).group(1).replace("\\\n", " ")
    words = shlex.split(command)
    assert words[:4] == ["PYTHONPATH=docs/examples", "python", "-m", "pipeline"], words[:4]
    run_dir = tmp_path / "run"
    done = run_pipeline([*words[4:], "progress=false", f"hydra.run.dir={run_dir}"], tmp_path, timeout=300,
                        env={"PYTHONPATH": str(ROOT / "docs" / "examples") + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "target_return:" in done.stdout + done.stderr, done.stdout[-2000:]
    assert (run_dir / "checkpoint.pt").exists()
