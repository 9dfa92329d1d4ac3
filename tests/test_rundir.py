"""Run directories: an atomic claim, refusals that touch nothing, budgets before start."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import stat

import pytest

from pipeline.runner.budgets import check_budgets, transition_bytes
from pipeline.plan import Machine, resolve_plan
from pipeline.runner.run_lock import LOCK, claim_run_dir
from pipeline.plan.validate import ConfigError
from tests.conftest import compose
from tests.run_claims import claim_and_hold

CTX = mp.get_context("spawn")


def test_of_many_processes_claiming_one_directory_exactly_one_wins(tmp_path):
    results, release = CTX.Queue(), CTX.Event()
    procs = [CTX.Process(target=claim_and_hold, args=(str(tmp_path / "run"), results, release), daemon=True)
             for _ in range(6)]
    try:
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=60) for _ in procs)
    finally:
        release.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert outcomes == ["refused"] * 5 + ["won"]


def test_a_directory_whose_owner_still_runs_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    claim = claim_run_dir(run_dir)  # this process owns it (holds its flock) and is alive
    with pytest.raises(ConfigError, match="is still using it"):
        claim_run_dir(run_dir, resume=True)
    claim.release()
    (run_dir / LOCK).write_text(json.dumps({"pid": 2**22 + 12345, "host": os.uname().nodename}))
    (run_dir / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="already holds a run .*resume=<run dir>"):
        claim_run_dir(run_dir)
    claim_run_dir(run_dir, resume=True).release()
    assert json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()


def test_resuming_a_directory_without_a_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no run to resume"):
        claim_run_dir(tmp_path / "empty", resume=True)


def test_budgets_refuse_buffers_that_cannot_fit_before_anything_starts(tmp_path):
    from components.envs import EnvSpec

    cartpole = EnvSpec((4,), "float32", "discrete", action_n=2)
    frames = EnvSpec((4, 84, 84), "uint8", "discrete", action_n=6)
    machine = Machine(cpus=2, cuda=False)
    cfg = compose("trainer=dqn", "replay=uniform", "replay.storage=disk", "replay.capacity=10000000000")
    with pytest.raises(ConfigError, match=r"replay.capacity=10000000000: a disk replay of about .* GB does not fit"):
        check_budgets(cfg, resolve_plan(cfg, machine, cartpole), cartpole, tmp_path)
    cfg = compose("env=atari", "trainer=dqn", "replay=uniform", "replay.capacity=100000000")
    with pytest.raises(ConfigError, match=r"replay.capacity=100000000: the run needs about .* of memory"):
        check_budgets(cfg, resolve_plan(cfg, machine, frames), frames, tmp_path)
    cfg = compose("trainer.frames_per_batch=10000000000", "trainer.total_frames=100000000000")
    with pytest.raises(ConfigError, match=r"trainer.frames_per_batch=10000000000: the run needs about"):
        check_budgets(cfg, resolve_plan(cfg, machine, cartpole), cartpole, tmp_path)
    cfg = compose()
    check_budgets(cfg, resolve_plan(cfg, machine, cartpole), cartpole, tmp_path)  # the default fits
    assert transition_bytes(frames, frame_dedup=True) < transition_bytes(frames) / 6


def test_the_disk_reserve_is_allocated_up_front_and_released_once(tmp_path):
    from pipeline.runner.rundir import DiskReserve

    reserve = DiskReserve(tmp_path, 1 << 20)
    assert reserve.path.stat().st_size == 1 << 20
    assert reserve.path.stat().st_blocks * 512 >= 1 << 20, "really allocated, not a sparse file"
    assert reserve.release() and not reserve.path.exists()
    assert not reserve.release()


def test_a_disk_without_room_for_the_reserve_is_one_config_error(tmp_path, monkeypatch):
    import errno

    from pipeline.runner.rundir import DiskReserve

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match=r"cannot keep 9 MB free for the final checkpoint \(No space left"):
        DiskReserve(tmp_path, 9_000_000)
    assert not (tmp_path / DiskReserve.NAME).exists()


def _modes(run_dir) -> dict[str, int]:  # noqa: ANN001
    return {name: stat.S_IMODE((run_dir / name).stat().st_mode)
            for name in (".", "checkpoint.pt", "metrics.jsonl", ".run.lock", ".hydra", ".hydra/overrides.yaml")}


def test_a_real_run_leaves_its_directory_0700_and_files_0600_unless_rundir_mode_is_shared(tmp_path):
    from tests.conftest import run_pipeline

    args = ["trainer.total_frames=256", "trainer.target_return=null", "logger=jsonl", "progress=false",
            "checkpoint.interval=null"]
    old = os.umask(0o022)  # a typical login umask, inherited by the runs
    try:
        private = run_pipeline([*args, f"hydra.run.dir={tmp_path / 'private'}"], cwd=tmp_path)
        shared = run_pipeline([*args, "rundir.mode=shared", f"hydra.run.dir={tmp_path / 'shared'}"], cwd=tmp_path)
    finally:
        os.umask(old)
    assert private.returncode == 0, private.stderr[-2000:]
    assert shared.returncode == 0, shared.stderr[-2000:]
    modes = _modes(tmp_path / "private")
    assert modes == {".": 0o700, "checkpoint.pt": 0o600, "metrics.jsonl": 0o600, ".run.lock": 0o600,
                     ".hydra": 0o700, ".hydra/overrides.yaml": 0o600}, {k: oct(v) for k, v in modes.items()}
    loose = [str(p) for p in (tmp_path / "private").rglob("*") if not p.is_symlink() and p.stat().st_mode & 0o077]
    assert not loose, f"readable by others: {loose}"
    modes = _modes(tmp_path / "shared")
    assert modes == {".": 0o755, "checkpoint.pt": 0o644, "metrics.jsonl": 0o644, ".run.lock": 0o644,
                     ".hydra": 0o755, ".hydra/overrides.yaml": 0o644}, {k: oct(v) for k, v in modes.items()}


def test_an_unknown_rundir_mode_is_one_config_error():
    from pipeline.runner.rundir import apply_mode

    with pytest.raises(ConfigError, match=r"rundir.mode='public': one of private, group, shared"):
        apply_mode("public")


def _ray_launcher_config(*overrides: str):  # noqa: ANN202
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from pipeline.plan.schema import register
    from tests.conftest import CONF_DIR

    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="hydra-ray-launcher is not installed")
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=["hydra/launcher=ray", *overrides], return_hydra_config=True)


def test_the_ray_launchers_local_cluster_binds_loopback_without_a_dashboard(tmp_path, monkeypatch):
    from pipeline.runner import hydra_callbacks

    monkeypatch.setattr(hydra_callbacks, "_ray_temp_dirs", lambda: [tmp_path])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    cfg = _ray_launcher_config()
    hydra_callbacks.SweepReport().on_multirun_start(cfg)  # what Hydra calls before the launcher starts Ray
    assert cfg.hydra.launcher.ray.init.include_dashboard is False
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0", "Ray's switch: every process binds 127.0.0.1"
    cfg = _ray_launcher_config("+hydra.launcher.ray.init.include_dashboard=true")
    hydra_callbacks.SweepReport().on_multirun_start(cfg)
    assert cfg.hydra.launcher.ray.init.include_dashboard is True, "the user's choice stands"


@pytest.mark.parametrize("given", ["address", "RAY_ADDRESS", "a running cluster"])
def test_a_ray_cluster_the_user_names_is_left_as_it_is(tmp_path, monkeypatch, given):
    from pipeline.runner import hydra_callbacks

    monkeypatch.setattr(hydra_callbacks, "_ray_temp_dirs", lambda: [tmp_path])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    overrides = ["+hydra.launcher.ray.init.address=10.0.0.5:6379"] if given == "address" else []
    if given == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    if given == "a running cluster":
        (tmp_path / "ray_current_cluster").write_text("10.0.0.5:6379")
    cfg = _ray_launcher_config(*overrides)
    before = dict(cfg.hydra.launcher.ray.init)
    assert not hydra_callbacks.local_ray_defaults(cfg)
    assert dict(cfg.hydra.launcher.ray.init) == before
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
