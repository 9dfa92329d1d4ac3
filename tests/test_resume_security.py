"""``resume=<run dir>`` takes data, never code, from the directory; a bad directory is one line, exit 2.

A run directory may come from anyone (downloaded, shared, left in /tmp):
its ``.hydra/overrides.yaml`` and ``checkpoint.pt`` are attacker-controlled
input. The end-to-end tests run ``python -m pipeline`` as a user would and
check the exit code, that stderr is one line, that a planted payload never
ran (its marker file is never created) and that a refused directory is left
exactly as it was.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from components.checkpoint import load_checkpoint, save_checkpoint
from components.envs import EnvSpec
from components.models import ActorCritic, QNetwork
from components.trainers.dqn import DQNConfig, DQNTrainer
from components.trainers.ppo import PPOConfig, PPOTrainer
from pipeline.runner.resume import resume_argv, rewind_metrics
from pipeline.runner.saved_overrides import hydra_quote, project_configs, refusal
from pipeline.plan.validate import ConfigError
from tests.conftest import run_pipeline
from tests.test_resume import saved_run

SMALL = ["workers=thread", "logger=jsonl", "progress=false", "trainer.target_return=null", "checkpoint.interval=null"]


class _Payload:
    """Unpickled with ``weights_only=False``, this creates ``marker``: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.marker, "w"))


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root`` (and ``root`` itself) with its size, mtime and mode."""
    out = {".": (0, root.stat().st_mtime_ns, root.stat().st_mode)}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        out[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns, info.st_mode)
    return out


def _write_overrides(run_dir: Path, items: list[str]) -> None:
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(items))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2000-frame run in a directory named the way Hydra's override_dirname names them."""
    root = tmp_path_factory.mktemp("real")
    run_dir = root / "sweep" / "lr=0.1,seed=1"
    result = run_pipeline(["trainer.total_frames=2000", *SMALL, "logger.tags=['a,b',\"it's\"]",
                           f"hydra.run.dir={hydra_quote(str(run_dir))}"], cwd=root, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "checkpoint.pt").is_file()
    return run_dir


def _copy(run_dir: Path, tmp_path: Path, name: str | None = None) -> Path:
    dest = tmp_path / (name or run_dir.name)
    shutil.copytree(run_dir, dest)
    (dest / ".run.lock").unlink(missing_ok=True)
    return dest


# --- crafted directories: nothing runs ---------------------------------------------------------------


def _crafted(tmp_path: Path, items: list[str]) -> tuple[Path, Path]:
    run_dir = saved_run(tmp_path, ["workers=thread", "logger=jsonl", "progress=false"])
    marker = tmp_path / "MARKER"
    items = [item.replace("{dir}", str(run_dir)).replace("{marker}", str(marker)) for item in items]
    _write_overrides(run_dir, ["workers=thread", "logger=jsonl", "progress=false", *items])
    (run_dir / "payload.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    return run_dir, marker


@pytest.mark.parametrize("items, named", [
    # the payload: torch.load of a pickle planted in the directory
    (["env.factory._target_=torch.load", "~env.factory.id", "+env.factory.f={dir}/payload.pkl",
      "+env.factory.weights_only=false"],
     ["env.factory._target_=torch.load", "+env.factory.f=", "+env.factory.weights_only=false"]),
    # a Hydra callback: instantiated by Hydra itself, before the task
    (["+hydra.callbacks.x._target_=builtins.open", "+hydra.callbacks.x.file={marker}", "+hydra.callbacks.x.mode=w"],
     ["+hydra.callbacks.x._target_=builtins.open", "+hydra.callbacks.x.file=", "+hydra.callbacks.x.mode=w"]),
], ids=["torch.load-pickle", "hydra.callbacks"])
def test_a_crafted_run_directory_is_refused_in_one_line_and_its_payload_never_runs(tmp_path, items, named):
    run_dir, marker = _crafted(tmp_path, items)
    before = _snapshot(run_dir)
    result = run_pipeline([f"resume={run_dir}", "trainer.total_frames=4000"], cwd=tmp_path, timeout=60)
    assert not marker.exists(), "code from the run directory ran"
    assert result.returncode == 2, result.stderr[-3000:]
    lines = _lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("config error: "), result.stderr[-3000:]
    assert f"refused {len(named)} item(s)" in lines[0] and "restate them on the command line" in lines[0]
    for item in named:
        assert item in lines[0]
    assert "~env.factory.id" not in lines[0], "deleting an argument is data"
    assert _snapshot(run_dir) == before


def test_restated_items_are_accepted_and_project_targets_pass_unasked(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    saved = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    extra = "+env.factory.kwargs={max_episode_steps:50}"  # adds an argument to the env factory's call
    _write_overrides(run_dir, [*saved, "model._target_=components.models.ActorCritic", extra])
    refused = run_pipeline([f"resume={run_dir}", "trainer.total_frames=2560"], cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and "refused 1 item(s)" in refused.stderr, refused.stderr[-3000:]
    assert extra in refused.stderr and "model._target_" not in refused.stderr
    accepted = run_pipeline([f"resume={run_dir}", "trainer.total_frames=2560", extra], cwd=tmp_path, timeout=90)
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert config.env.factory.kwargs.max_episode_steps == 50
    assert config.model._target_ == "components.models.ActorCritic"


# --- resume of any path --------------------------------------------------------------------------------


def test_a_run_directory_with_commas_and_equals_in_its_path_resumes(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path / "lr=0.1,seed=1 it's $HOME")
    result = run_pipeline([f"resume={run_dir}", "trainer.total_frames=2560"], cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(line)["summary"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                 if '"summary"' in line]
    assert summaries and summaries[-1]["frames"] == 2560
    config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert config.resume == str(run_dir.resolve())
    assert list(config.logger.tags) == ["a,b", "it's"], "a saved value with a comma and a quote round-trips"


@pytest.mark.parametrize("text", ["runs/lr=0.1,seed=1", "a b'c\"d", "$HOME ${x} \\${y} \\\\${z}", "tail\\",
                                  "[x]{y}(z):=,", "é"])
def test_hydra_quote_composes_back_to_the_text(text):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = OverridesParser.create().parse_override(f"k={hydra_quote(text)}").value()
    assert OmegaConf.create({"k": value}).k == text


# --- bad files: one line, exit 2, nothing written -----------------------------------------------------


def _damage(run_dir: Path, how: str, marker: Path) -> None:
    path = run_dir / "checkpoint.pt"
    good = path.read_bytes()
    path.unlink()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif how == "garbage":
        path.write_bytes(b"not a checkpoint\n" * 64)
    elif how == "foreign":
        torch.save({"weights": torch.zeros(3)}, path)
    elif how == "pickled-code":
        torch.save({"frames": _Payload(marker)}, path)
    elif how == "directory":
        path.mkdir()


@pytest.mark.parametrize("how", ["missing", "empty", "truncated", "garbage", "foreign", "pickled-code", "directory"])
def test_a_damaged_checkpoint_is_one_line_exit_2_and_the_directory_is_unchanged(tmp_path, how):
    run_dir = saved_run(tmp_path, ["workers=thread", "logger=jsonl", "progress=false"])
    marker = tmp_path / "MARKER"
    _damage(run_dir, how, marker)
    before = _snapshot(run_dir)
    result = run_pipeline([f"resume={run_dir}"], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = _lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("config error: resume="), result.stderr[-3000:]
    assert "checkpoint.pt" in lines[0]
    assert not marker.exists()
    assert _snapshot(run_dir) == before


def test_invalid_yaml_in_the_overrides_is_one_line_exit_2(tmp_path):
    run_dir = saved_run(tmp_path, [])
    (run_dir / ".hydra" / "overrides.yaml").write_text("- seed=1\n- [unclosed\n")
    before = _snapshot(run_dir)
    result = run_pipeline([f"resume={run_dir}"], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = _lines(result.stderr)
    assert len(lines) == 1 and "overrides.yaml is not valid YAML" in lines[0], result.stderr[-3000:]
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("content, message", [
    ("seed: 1\n", "not a YAML list of override strings"),
    ("- 1\n- seed=2\n", "not a YAML list of override strings"),
    ("- seed=[1\n", "not an override Hydra's grammar parses"),
    ("- seed=1,2\n", "holds the sweep"),
])
def test_an_overrides_file_that_is_no_list_of_overrides_is_a_config_error(tmp_path, content, message):
    run_dir = saved_run(tmp_path, [])
    (run_dir / ".hydra" / "overrides.yaml").write_text(content)
    with pytest.raises(ConfigError, match=message):
        resume_argv([f"resume={run_dir}"])


# --- what counts as code -------------------------------------------------------------------------------


@pytest.mark.parametrize("item", [
    "env.factory._target_=torch.load",
    "+hydra.callbacks.x._target_=builtins.open",
    "hydra.job.chdir=true",
    "hydra/launcher=joblib",
    "trainer._partial_=true",
    "+env.factory._args_=[1]",
    "collector.post_collect_hook=os.getcwd",
    "logger.extra_sinks=[tests.blocking_sink.BlockingSink]",
    "env.id=antigravity:Fly-v0",
    "env.factory={_target_:os.system,command:x}",
    "+env.factory.kwargs={a:{_target_:os.system}}",
    "+env.factory.f=/tmp/x",
    "logger.project=${oc.env:HOME}",
    "logger.tags=[a,'${oc.decode:x}']",
    "env=../../../tmp/evil",
    "env@env.factory=cartpole",
    "~env.factory",
    "ray.runtime_env={pip:[evil]}",
    "ray.address=ray://evil:10001",
])
def test_items_that_import_or_call_code_are_refused(item):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert refusal(OverridesParser.create().parse_override(item), project_configs()) is not None


@pytest.mark.parametrize("item", [
    "trainer.lr=0.001", "env=atari", "trainer=dqn", "experiment=null", "model._target_=components.models.QNetwork",
    "env.id=Acrobot-v1", "logger.tags=['a,b',\"it's\"]", "logger.project=${env.name}",
    "collector.post_collect_hook=null", "ray.address=local", "seed=3", "~env.factory.id", "logger.extra_sinks=[]",
])
def test_items_that_only_set_values_are_replayed(item):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert refusal(OverridesParser.create().parse_override(item), project_configs()) is None


def test_the_allowed_targets_come_from_the_config_tree():
    targets = project_configs().targets
    assert {"components.envs.GymEnvFactory", "components.models.QNetwork", "components.trainers.dqn.DQNTrainer",
            "components.trainers.ppo.PPOTrainer", "components.metrics.MetricsLogger"} <= targets
    assert all(t.startswith(("components.", "pipeline.")) for t in targets)


def test_a_restated_item_is_the_users_and_replaces_the_saved_one(tmp_path):
    run_dir = saved_run(tmp_path, ["seed=3", "collector.post_collect_hook=os.getcwd"])
    with pytest.raises(ConfigError, match=r"refused 1 item\(s\).*collector\.post_collect_hook=os\.getcwd"):
        resume_argv([f"resume={run_dir}"])
    argv = resume_argv([f"resume={run_dir}", "collector.post_collect_hook=os.getcwd"])
    assert argv[:2] == ["seed=3", "collector.post_collect_hook=os.getcwd"]


# --- the side of the run that reads files ---------------------------------------------------------------


def test_rewinding_metrics_keeps_damaged_rows_in_a_side_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = ['{"frames": 100}', '{"frames": 200, "x": 1', '{"frames": 300}', "[1, 2]", '{"frames": 400}',
             '{"summary": {"frames": 400}}']
    path.write_text("\n".join(lines) + '\n{"fra')
    assert rewind_metrics(path, 350) == 2
    assert [json.loads(line)["frames"] for line in path.read_text().splitlines()] == [100, 300]
    side = tmp_path / "metrics.jsonl.damaged"
    assert side.read_text().splitlines() == ['{"frames": 200, "x": 1', "[1, 2]", '{"fra']
    path.write_text('{"frames": 100}\n{"oops\n')
    rewind_metrics(path, 350)
    assert side.read_text().splitlines()[-1] == '{"oops' and len(side.read_text().splitlines()) == 4, "appended"


def test_load_checkpoint_unpickles_no_code_and_still_loads_both_trainers(tmp_path):
    marker = tmp_path / "MARKER"
    torch.save({"model": _Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(tmp_path / "evil.pt")
    assert not marker.exists()
    spec = EnvSpec((4,), "float32", "discrete", action_n=2)
    for trainer, fresh in (
        (PPOTrainer(ActorCritic(spec), PPOConfig(total_frames=1000), policy_version=3),
         PPOTrainer(ActorCritic(spec), PPOConfig(total_frames=1000))),
        (DQNTrainer(QNetwork(spec), DQNConfig(total_frames=1000), policy_version=3),
         DQNTrainer(QNetwork(spec), DQNConfig(total_frames=1000))),
    ):
        path = save_checkpoint(tmp_path / f"{type(trainer).__name__}.pt", trainer.state_dict())
        fresh.load_state_dict(load_checkpoint(path))
        assert fresh.policy_version == 3


def test_a_fifo_named_metrics_jsonl_is_refused_before_it_blocks(tmp_path):
    run_dir = saved_run(tmp_path, [])
    os.mkfifo(run_dir / "metrics.jsonl")
    with pytest.raises(ConfigError, match="metrics.jsonl is not a regular file"):
        resume_argv([f"resume={run_dir}"])


def test_pyproject_admits_only_hydra_releases_with_the_target_blocklist():
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    from tests.conftest import ROOT

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (hydra,) = [Requirement(d) for d in deps if Requirement(d).name == "hydra-core"]
    assert not any(v in hydra.specifier for v in ("1.3.0", "1.3.2", "1.3.3")), "no blocklist before 1.3.4"
    assert Version("1.3.8") in hydra.specifier
    from hydra._internal.instantiate import _instantiate2  # the installed one has it

    assert "_authorize_target_name" in vars(_instantiate2) or hasattr(_instantiate2, "_is_blocklisted_target")


def test_a_checkpoint_whose_replay_names_files_outside_the_run_is_refused(tmp_path):
    run_dir = saved_run(tmp_path, [])
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    state["replay"] = {"storage": {"layout": [[["..", "..", "evil"], [1], "float32"]]}}
    torch.save(state, run_dir / "checkpoint.pt")
    with pytest.raises(ConfigError, match="outside the replay directory"):
        resume_argv([f"resume={run_dir}"])
