"""The run-directory claim under races and odd lock files (issue 21, holes 2, 3 and 6).

Real spawned processes race for one directory per trial, released together
at a barrier: the kernel (one ``flock``) must let exactly one of them win
every time. Odd ``.run.lock`` files are each refused or taken over with
one line, never a traceback and never a signal sent to pid 0 or -1.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.runner.run_lock import LOCK, claim_run_dir
from pipeline.plan.validate import ConfigError

CTX = mp.get_context("spawn")
TRIALS = 200


def _contender(root: str, trials: int, start: Any, done: Any, results: Any, resume: bool) -> None:
    """Claim ``root/<i>`` for each trial at the same moment as the other contender; hold it until both answered."""
    for i in range(trials):
        start.wait(30)
        try:
            claim = claim_run_dir(Path(root) / str(i), resume=resume)
            won = True
        except ConfigError:
            claim, won = None, False
        results.put(("won", i, won))
        done.wait(30)  # the winner holds the directory until the other one has answered
        intact = None
        if claim is not None and hasattr(claim, "release"):
            lock = Path(root) / str(i) / LOCK  # still the file it locked: the loser removed nothing of the winner's
            intact = lock.exists() and os.path.samestat(os.fstat(claim.fd), os.lstat(lock))
            claim.release()
        results.put(("intact", i, intact))


@pytest.mark.parametrize("lock", ["none", "stale"])
def test_two_processes_claiming_one_directory_200_times_never_both_win(tmp_path, lock):
    """``none``: two new runs of one hydra.run.dir; ``stale``: two resumes of a killed run (its lock taken over)."""
    if lock == "stale":
        dead = _dead_pid()
        for i in range(TRIALS):
            (tmp_path / str(i)).mkdir()
            (tmp_path / str(i) / "checkpoint.pt").write_bytes(b"")
            (tmp_path / str(i) / LOCK).write_text(json.dumps({"v": 2, "pid": dead, "host": socket.gethostname(),
                                                              "started": time.time()}))
    start, done, results = CTX.Barrier(2), CTX.Barrier(2), CTX.Queue()
    procs = [CTX.Process(target=_contender, args=(str(tmp_path), TRIALS, start, done, results, lock == "stale"),
                         daemon=True) for _ in range(2)]
    try:
        for p in procs:
            p.start()
        wins: dict[int, int] = {}
        lost_locks = []
        deadline = time.monotonic() + 60
        for _ in range(4 * TRIALS):
            kind, i, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if kind == "won":
                wins[i] = wins.get(i, 0) + int(value)
            elif value is False:
                lost_locks.append(i)
        for p in procs:
            p.join(15)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    both = sorted(i for i, n in wins.items() if n > 1)
    assert not both, f"both processes won {len(both)} of {TRIALS} trials"
    assert sorted(wins.values()) == [1] * TRIALS, "exactly one winner per trial"
    assert not lost_locks, f"the loser removed the winner's lock file in {len(lost_locks)} trials"


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _hold_lock(run_dir: str, ready: Any) -> None:
    from pipeline.runner.run_lock import claim_run_dir

    claim_run_dir(Path(run_dir))
    ready.set()
    time.sleep(60)


def test_the_lock_of_a_killed_run_is_taken_over_and_a_live_one_is_not(tmp_path):
    run_dir = tmp_path / "run"
    ready = CTX.Event()
    holder = CTX.Process(target=_hold_lock, args=(str(run_dir), ready), daemon=True)
    try:
        holder.start()
        assert ready.wait(30)
        (run_dir / "checkpoint.pt").write_bytes(b"")
        with pytest.raises(ConfigError, match=rf"the run of pid {holder.pid} on .* is still using it"):
            claim_run_dir(run_dir, resume=True)
        os.kill(holder.pid, signal.SIGKILL)  # no clean-up: the lock file stays, naming a dead pid
        holder.join(10)
    finally:
        if holder.is_alive():
            holder.kill()
            holder.join(5)
    assert json.loads((run_dir / LOCK).read_text())["pid"] == holder.pid
    claim = claim_run_dir(run_dir, resume=True)
    try:
        assert json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()
    finally:
        claim.release()


def test_a_lock_whose_pid_was_reused_by_a_live_process_is_taken_over(tmp_path):
    """The pid in a lock file proves nothing (pids are reused); only a held lock blocks."""
    run_dir = tmp_path / "run"
    claim_run_dir(run_dir).release()
    (run_dir / LOCK).write_text(json.dumps({"v": 2, "pid": os.getppid(), "host": socket.gethostname(),
                                            "started": time.time()}))
    (run_dir / "checkpoint.pt").write_bytes(b"")
    claim_run_dir(run_dir, resume=True).release()


ODD_LOCKS = {
    "list": b"[]",
    "object": b"{}",
    "null pid": b'{"pid": null}',
    "string pid": b'{"pid": "x"}',
    "pid 0": b'{"pid": 0, "host": "HOST"}',
    "pid -1": b'{"pid": -1, "host": "HOST"}',
    "true pid": b'{"pid": true, "host": "HOST"}',
    "huge pid": b'{"pid": 99999999999999999999, "host": "HOST"}',
    "binary": bytes(range(256)) * 4,
    "deep": b"[" * 100000,
    "empty": b"",
}


@pytest.mark.parametrize("content", ODD_LOCKS.values(), ids=ODD_LOCKS.keys())
def test_odd_lock_contents_never_signal_pid_0_or_minus_1_and_are_taken_over(tmp_path, monkeypatch, content):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK).write_bytes(content.replace(b"HOST", socket.gethostname().encode()))
    (run_dir / "checkpoint.pt").write_bytes(b"")
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        assert pid > 0, f"os.kill({pid}, {sig}) would signal a process group"
        real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    with pytest.raises(ConfigError, match="already holds a run") as refused:
        claim_run_dir(run_dir)
    assert "\n" not in str(refused.value)
    assert (run_dir / LOCK).read_bytes() == content.replace(b"HOST", socket.gethostname().encode()), \
        "a refused run changes nothing"
    claim_run_dir(run_dir, resume=True).release()  # nobody holds it: a stale lock, taken over
    assert json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()


def test_a_lock_that_is_not_a_regular_file_is_one_line_and_left_alone(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / LOCK).mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"{LOCK} is a directory, not a lock file; remove it") as refused:
        claim_run_dir(run_dir)
    assert "\n" not in str(refused.value) and (run_dir / LOCK).is_dir()
    os.rmdir(run_dir / LOCK)
    os.mkfifo(run_dir / LOCK)
    with pytest.raises(ConfigError, match=rf"{LOCK} is a FIFO, not a lock file"):
        claim_run_dir(run_dir)  # and no hang opening it
    os.unlink(run_dir / LOCK)
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    os.symlink(target, run_dir / LOCK)
    with pytest.raises(ConfigError, match=rf"{LOCK} is a symbolic link"):
        claim_run_dir(run_dir)
    assert target.read_text() == "precious", "a planted link redirects nothing"
    os.unlink(run_dir / LOCK)
    os.link(target, run_dir / LOCK)
    with pytest.raises(ConfigError, match=rf"{LOCK} is a hard link to another file"):
        claim_run_dir(run_dir)
    assert target.read_text() == "precious"


def test_a_pid_file_lock_of_an_older_version_naming_a_live_pid_is_refused_with_the_take_over_command(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"")
    (run_dir / LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "started": 1.0}))
    with pytest.raises(ConfigError, match=r"an older pid-file claim.*if that is not the run \(pids are reused\), "
                                          r"take it over with: python -m pipeline resume=.* rundir.take_over=true"):
        claim_run_dir(run_dir, resume=True)
    claim_run_dir(run_dir, resume=True, take_over=True).release()


def test_a_lock_from_another_host_is_refused_with_the_command_that_takes_it_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.pt").write_bytes(b"")
    (run_dir / LOCK).write_text(json.dumps({"v": 2, "pid": 123, "host": "host-b", "started": time.time()}))
    with pytest.raises(ConfigError) as refused:
        claim_run_dir(run_dir, resume=True)
    text = str(refused.value)
    assert "\n" not in text and "pid 123 on host-b" in text
    assert text.endswith(f"python -m pipeline resume={run_dir} rundir.take_over=true"), text
    claim_run_dir(run_dir, resume=True, take_over=True).release()
    owner = json.loads((run_dir / LOCK).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname() and "ended" in owner
    # a run on another host that ended cleanly says so in its lock: nothing to take over
    (run_dir / LOCK).write_text(json.dumps({"v": 2, "pid": 123, "host": "host-b", "started": 1.0, "ended": 2.0}))
    claim_run_dir(run_dir, resume=True).release()


def test_a_refused_claim_of_a_directory_without_a_lock_leaves_no_lock(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="already holds a run"):
        claim_run_dir(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_the_lock_is_not_inherited_by_children(tmp_path):
    """A worker that outlives its driver (or a forked child) must not keep the directory claimed."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    claim = claim_run_dir(run_dir)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], close_fds=False)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the forked child
        time.sleep(30)
        os._exit(0)
    try:
        claim.release()
        (run_dir / "checkpoint.pt").write_bytes(b"")
        claim_run_dir(run_dir, resume=True).release()  # neither child holds the lock
    finally:
        child.kill()
        child.wait(5)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
