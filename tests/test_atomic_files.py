"""Atomic, durable, link-proof writes (issue 21, holes 7 and the durability rows).

:func:`components.atomic_files.write_atomic` itself, then every writer that
must use it: the checkpoint, ``.hydra/*.yaml``, the sweep records, and the
disk replay, whose memory-mapped rows must be on disk before the
checkpoint that counts them.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch

from components import atomic_files
from components.atomic_files import write_atomic


@pytest.fixture
def fsynced(monkeypatch):
    """The paths ``os.fsync`` was called on, in order (directories end with ``/``)."""
    calls: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        calls.append(path + ("/" if stat.S_ISDIR(os.fstat(fd).st_mode) else ""))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def _leftovers(directory: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


def test_write_atomic_replaces_the_file_whole_with_mode_0600_and_fsyncs_file_then_directory(tmp_path, fsynced):
    path = tmp_path / "state.json"
    path.write_text("old")
    reader = path.open()  # a reader holding the old file keeps reading the old file
    old_umask = os.umask(0)  # the mode is the writer's, not the umask's loosest
    try:
        write_atomic(path, "new")
    finally:
        os.umask(old_umask)
    assert path.read_text() == "new" and reader.read() == "old"
    reader.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _leftovers(tmp_path, {"state.json"}) == []
    assert fsynced[-1] == f"{tmp_path}/", "the directory is fsynced after the rename"
    assert any(".state.json.tmp" in p for p in fsynced[:-1]), "the data is fsynced before the rename"


def test_write_atomic_refuses_a_symlink_planted_at_its_temporary_name(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    monkeypatch.setattr(atomic_files.secrets, "token_hex", lambda n: "f00d")
    path = tmp_path / "out"
    os.symlink(victim, tmp_path / f".out.tmp-{os.getpid()}-f00d")
    with pytest.raises(FileExistsError):
        write_atomic(path, b"attacker-chosen")
    assert victim.read_text() == "precious" and not path.exists()


def test_write_atomic_replaces_a_symlink_at_the_destination_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "out")
    write_atomic(tmp_path / "out", b"data")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out").is_symlink() and (tmp_path / "out").read_bytes() == b"data"


@pytest.mark.parametrize("failing", ["write", "replace"])
def test_write_atomic_leaves_no_temporary_file_when_it_fails(tmp_path, monkeypatch, failing):
    path = tmp_path / "out"
    path.write_bytes(b"old")

    def broken(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, failing, broken)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, b"new" * 1000)
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert _leftovers(tmp_path, {"out"}) == []


# -- the writers that must use it ------------------------------------------------------------------
def _plant(directory: Path, names: list[str], victim: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        os.symlink(victim, directory / name)


def test_the_checkpoint_never_writes_through_a_planted_link_and_its_directory_is_fsynced(tmp_path, fsynced):
    from components.checkpoint import save_checkpoint

    victim = tmp_path / "victim"
    victim.write_text("precious")
    run_dir = tmp_path / "run"
    _plant(run_dir, [f".checkpoint.pt.tmp-{os.getpid()}", ".checkpoint.pt.tmp"], victim)  # the old fixed names
    save_checkpoint(run_dir / "checkpoint.pt", {"w": torch.ones(3)})
    assert victim.read_text() == "precious"
    assert torch.equal(torch.load(run_dir / "checkpoint.pt", weights_only=True)["w"], torch.ones(3))
    assert fsynced[-1] == f"{run_dir}/"


def test_a_failed_checkpoint_write_keeps_its_message_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    from components.checkpoint import save_checkpoint

    def full(fd: int, data) -> int:  # noqa: ANN001
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match=rf"No space left on device \(writing {tmp_path / 'checkpoint.pt'}\)"):
        save_checkpoint(tmp_path / "checkpoint.pt", {"w": torch.ones(3)})
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_hydra_files_and_sweep_records_never_write_through_a_planted_link(tmp_path):
    from omegaconf import OmegaConf

    from pipeline.runner.rundir import write_hydra_files
    from pipeline.runner.sweep import JobRecord, report, write_record

    victim = tmp_path / "victim"
    victim.write_text("precious")
    run_dir = tmp_path / "run"
    _plant(run_dir / ".hydra", [".config.yaml.tmp", ".hydra.yaml.tmp", ".overrides.yaml.tmp"], victim)
    write_hydra_files(run_dir, OmegaConf.create({"seed": 1}), OmegaConf.create({"hydra": {}}),
                      ["seed=1", "rundir.take_over=true"])
    assert victim.read_text() == "precious"
    assert OmegaConf.load(run_dir / ".hydra" / "overrides.yaml") == ["seed=1"], "a take-over is never replayed"
    sweep_dir = tmp_path / "sweep"
    _plant(sweep_dir / ".jobs", [f".0.json.{os.getpid()}"], victim)
    write_record(sweep_dir, JobRecord(0, ["seed=1"], str(run_dir), "finished", 0, 1.0))
    report(sweep_dir, "episode/return_mean", "maximize", ["python", "-m", "pipeline"])
    assert victim.read_text() == "precious"
    assert (sweep_dir / "sweep.jsonl").read_text().count("\n") == 1


def test_disk_replay_files_are_fsynced_by_the_state_dict_a_checkpoint_carries(tmp_path, fsynced):
    from tensordict import TensorDict

    from components.replay.buffer import ReplayBuffer
    from components.replay.storage import TensorStorage

    storage = TensorStorage(16, path=tmp_path / "rb")
    buffer = ReplayBuffer(storage, sampler="uniform", seed=0)
    n = 5
    buffer.extend(TensorDict({"observation": torch.ones(n, 3), "next": {"reward": torch.ones(n)}}, [n]))
    files = sorted(str(p) for p in (tmp_path / "rb").rglob("*.memmap"))
    assert len(files) == 2
    fsynced.clear()
    buffer.state_dict()
    assert set(files) <= set(fsynced), f"not flushed before the checkpoint: {sorted(set(files) - set(fsynced))}"
    assert f"{tmp_path / 'rb'}/" in fsynced


def test_the_disk_frame_pool_is_fsynced_by_its_state_dict(tmp_path, fsynced):
    from components.replay.frames import FrameStackStorage
    from tests.test_replay_frames import atari_stream

    storage = FrameStackStorage(64, path=tmp_path / "rb")
    storage.extend(atari_stream(num_envs=2, steps=10))
    fsynced.clear()
    storage.state_dict()
    assert str(tmp_path / "rb" / "frames.memmap") in fsynced
    assert any(p.startswith(str(tmp_path / "rb" / "transitions")) and p.endswith(".memmap") for p in fsynced)
