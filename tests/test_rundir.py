"""Run directories: an atomic claim, refusals that touch nothing, budgets before start."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from pipeline.budgets import check_budgets, transition_bytes
from pipeline.plan import Machine, resolve_plan
from pipeline.rundir import LOCK, claim_run_dir
from pipeline.validate import ConfigError
from tests.conftest import compose

CTX = mp.get_context("spawn")


def _claim(path: str, results) -> None:  # noqa: ANN001
    from pathlib import Path

    try:
        claim_run_dir(Path(path))
        results.put("won")
    except ConfigError:
        results.put("refused")


def test_of_many_processes_claiming_one_directory_exactly_one_wins(tmp_path):
    results = CTX.Queue()
    procs = [CTX.Process(target=_claim, args=(str(tmp_path / "run"), results), daemon=True) for _ in range(6)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert outcomes == ["refused"] * 5 + ["won"]


def test_a_directory_whose_owner_still_runs_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    claim_run_dir(run_dir)  # this process owns it and is alive
    with pytest.raises(ConfigError, match="is still using it"):
        claim_run_dir(run_dir, resume=True)
    (run_dir / LOCK).write_text(json.dumps({"pid": 2**22 + 12345, "host": os.uname().nodename}))
    (run_dir / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="already holds a run .*resume=<run dir>"):
        claim_run_dir(run_dir)
    claim_run_dir(run_dir, resume=True)
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
    from pipeline.rundir import DiskReserve

    reserve = DiskReserve(tmp_path, 1 << 20)
    assert reserve.path.stat().st_size == 1 << 20
    assert reserve.path.stat().st_blocks * 512 >= 1 << 20, "really allocated, not a sparse file"
    assert reserve.release() and not reserve.path.exists()
    assert not reserve.release()


def test_a_disk_without_room_for_the_reserve_is_one_config_error(tmp_path, monkeypatch):
    import errno

    from pipeline.rundir import DiskReserve

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match=r"cannot keep 9 MB free for the final checkpoint \(No space left"):
        DiskReserve(tmp_path, 9_000_000)
    assert not (tmp_path / DiskReserve.NAME).exists()
