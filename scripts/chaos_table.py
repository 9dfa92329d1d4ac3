"""The chaos table: every fault scenario in every layout, as a user meets it.

Runs ``python -m pipeline`` with faults injected (``tests.fakes.FaultyEnvFactory``)
and processes killed, for thread/process workers x thread/process server,
and prints one markdown row per (scenario, layout): the exit code, the
seconds that matter for the scenario (to react, or the whole run), what was
left behind (processes of the run's group, /dev/shm entries) and a verdict.

    python scripts/chaos_table.py                 # all scenarios, all layouts (~15 min on 2 CPUs)
    python scripts/chaos_table.py crash hang      # some scenarios

The tests in ``tests/chaos/`` assert the same things one by one; this is
the overview a reviewer reads.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.procs, when run as a script

from tests.procs import spawned_children  # noqa: E402
LAYOUTS = {
    "thread/thread": ["workers=thread", "server=thread", "transport=slots"],
    "process/thread": ["workers=process", "server=thread", "transport=slots"],
    "thread/process": ["workers=thread", "server=process", "transport=slots"],
    "process/process": ["workers=process", "server=process", "transport=slots"],
}
BASE = ["env.num_envs=8", "env.envs_per_worker=2", "trainer.target_return=null", "logger=jsonl",
        "logger.interval=0.5", "progress=false", "checkpoint.interval=2"]
FAULTY = ["env.factory._target_=tests.fakes.FaultyEnvFactory", "transport=slots"]  # faults are the workers' (no probe)


@dataclass
class Outcome:
    code: int | None
    seconds: float
    ok: bool
    detail: str


RUNS: list[Run] = []  # of the current row, to count what they left behind


class Run:
    """One ``python -m pipeline`` in its own process group, with helpers to poke it."""

    def __init__(self, args: list[str], run_dir: Path, *, set_dir: bool = True) -> None:
        self.run_dir = run_dir
        env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(ROOT)}
        self.started = time.monotonic()
        RUNS.append(self)
        where = [f"hydra.run.dir={run_dir}"] if set_dir else []
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args, *where],
                                     cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.out = self.err = ""

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_rows(self, n: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.rows()) < n and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.05)

    def children(self) -> list[int]:
        """The runner's spawned children (workers, server), oldest first."""
        return [pid for _, pid, _ in spawned_children(self.proc.pid)]

    def finish(self, timeout: float = 300.0) -> int | None:
        try:
            self.out, self.err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.out, self.err = self.proc.communicate()
            return None
        return self.proc.returncode

    def errors(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error:")]

    def left_behind(self) -> int:
        alive = 0
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                    alive += 1
        return alive


def _summary(run: Run) -> dict:
    rows = run.rows()
    return rows[-1].get("summary", {}) if rows else {}


def _max(run: Run, key: str) -> float:
    return max((r.get(key, 0) or 0 for r in run.rows() if "summary" not in r), default=0)


# ------------------------------------------------------------------ scenarios
def crash_restart(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, *FAULTY, "+env.factory.at_step=300", f"+env.factory.once={tmp / 'm'}",
               "trainer.total_frames=8000"], tmp / "run")
    code = run.finish()
    frames, restarts = _summary(run).get("frames"), _max(run, "collector/worker_restarts")
    return Outcome(code, time.monotonic() - run.started, code == 0 and frames == 8000 and restarts == 1,
                   f"one env of 4 workers crashed: {frames} frames, worker_restarts={restarts:g}")


def crash_repeated(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, *FAULTY, "+env.factory.at_step=300", "workers.max_restarts=2",
               "trainer.total_frames=100000"], tmp / "run")
    code = run.finish()
    errors = run.errors()
    ok = code == 1 and len(errors) == 1 and "workers.max_restarts=2" in errors[0]
    return Outcome(code, time.monotonic() - run.started, ok, errors[0][:90] if errors else "no error line")


def hang(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, *FAULTY, "+env.factory.at_step=300", "+env.factory.fault=hang",
               f"+env.factory.once={tmp / 'm'}", "workers.step_timeout=3", "trainer.total_frames=40000"],
              tmp / "run")  # long enough that the other workers do not finish the budget before the watchdog fires
    code = run.finish()
    stuck = re.search(r"returned for (\d+) s", run.err)
    waited = float(stuck.group(1)) if stuck else float("nan")
    if "workers=process" in layout:  # killed and replaced
        ok = code == 0 and _max(run, "collector/worker_restarts") == 1 and waited <= 5
        detail = f"hung worker killed after {waited:g} s and replaced; run finished"
    else:  # a thread cannot be killed: one line, exit 1
        ok = code == 1 and len(run.errors()) == 1 and "thread cannot be killed" in run.err and waited <= 5
        detail = f"stopped after {waited:g} s with one line (a thread cannot be killed)"
    return Outcome(code, waited, ok, detail)


def kill_worker(layout: list[str], tmp: Path) -> Outcome:
    if "workers=process" not in layout:
        return Outcome(None, 0.0, True, "n/a: thread workers (a crash is the `crash` rows)")
    run = Run([*layout, *BASE, "trainer.total_frames=20000"], tmp / "run")
    run.wait_rows(2)
    os.kill(run.children()[-1], signal.SIGKILL)
    code = run.finish()
    restarts, frames = _max(run, "collector/worker_restarts"), _summary(run).get("frames")
    return Outcome(code, time.monotonic() - run.started, code == 0 and restarts == 1 and frames == 20000,
                   f"replaced: worker_restarts={restarts:g}, {frames} frames")


def kill_server(layout: list[str], tmp: Path, restarts: int = 1) -> Outcome:
    if "server=process" not in layout:
        return Outcome(None, 0.0, True, "n/a: the server is a thread of the runner")
    run = Run([*layout, *BASE, f"server.max_restarts={restarts}", "trainer.total_frames=20000"], tmp / "run")
    run.wait_rows(2)
    os.kill(run.children()[0], signal.SIGKILL)
    killed = time.monotonic()
    code = run.finish()
    if restarts:
        took = re.search(r"restarted with the weights of version \d+ in ([\d.]+) s", run.err)
        seconds = float(took.group(1)) if took else float("nan")
        ok = code == 0 and _max(run, "collector/server_restarts") == 1 and _summary(run).get("frames") == 20000
        return Outcome(code, seconds, ok, f"restarted in {seconds:g} s with the latest weights; run finished")
    errors = run.errors()
    ok = code == 1 and errors == ["error: inference server (process) died: its process exited with code -9"]
    return Outcome(code, time.monotonic() - killed, ok, "exit 1 with: " + (errors[0] if errors else "no error line"))


def kill_server_no_restart(layout: list[str], tmp: Path) -> Outcome:
    return kill_server(layout, tmp, restarts=0)


def _signal_mid_run(layout: list[str], tmp: Path, sig: signal.Signals) -> Outcome:
    run = Run([*layout, *BASE, "trainer.total_frames=200000"], tmp / "run")
    run.wait_rows(2)
    os.killpg(run.proc.pid, sig)
    sent = time.monotonic()
    code = run.finish()
    summary = _summary(run)
    ok = code == 130 and summary.get("stop_reason", "").startswith("interrupted") \
        and (run.run_dir / "checkpoint.pt").exists()
    return Outcome(code, time.monotonic() - sent, ok, f"summary '{summary.get('stop_reason')}', checkpoint written")


def sigint_mid_run(layout: list[str], tmp: Path) -> Outcome:
    return _signal_mid_run(layout, tmp, signal.SIGINT)


def sigterm_mid_run(layout: list[str], tmp: Path) -> Outcome:
    return _signal_mid_run(layout, tmp, signal.SIGTERM)


def sigint_start_up(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE], tmp / "run")
    time.sleep(2.5)  # the interpreter is up, the graph is being built
    os.killpg(run.proc.pid, signal.SIGINT)
    sent = time.monotonic()
    code = run.finish()
    lines = [line for line in run.err.splitlines() if line.strip() and not line.startswith("wandb:")]
    early = not (run.run_dir / "metrics.jsonl").exists()
    ok = code == 130 and "Traceback" not in run.err and (not early or len(lines) == 1)
    return Outcome(code, time.monotonic() - sent, ok, lines[-1][:90] if lines else "")


def nan_error(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, *FAULTY, "+env.factory.at_step=200", "+env.factory.fault=nan_reward"], tmp / "run")
    code = run.finish()
    errors = run.errors()
    ok = code == 1 and len(errors) == 1 and "non-finite reward nan" in errors[0]
    return Outcome(code, time.monotonic() - run.started, ok, errors[0][:90] if errors else "no error line")


def nan_skip(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, *FAULTY, "+env.factory.at_step=200", "+env.factory.fault=nan_obs",
               f"+env.factory.once={tmp / 'm'}", "trainer.nan_policy=skip", "trainer.total_frames=8000"],
              tmp / "run")
    code = run.finish()
    skipped = _max(run, "collector/non_finite_skipped")
    return Outcome(code, time.monotonic() - run.started, code == 0 and skipped == 1,
                   f"non_finite_skipped={skipped:g}, {_summary(run).get('frames')} frames")


_FILL = r"""
mount -t tmpfs -o size=24m tmpfs "$MNT" || exit 99
"$PY" -m pipeline $ARGS trainer=dqn replay=uniform replay.storage=disk replay.capacity=100000 \
    trainer.total_frames=200000 hydra.run.dir="$MNT/run" > "$OUT/stdout" 2> "$OUT/stderr" &
runner=$!
for _ in $(seq 900); do [ "$(cat "$MNT/run/metrics.jsonl" 2>/dev/null | wc -l)" -ge 3 ] && break; sleep 0.1; done
dd if=/dev/zero of="$MNT/filler" bs=64k 2>/dev/null
date +%s.%N > "$OUT/filled"
wait $runner; echo $? > "$OUT/exit"; date +%s.%N > "$OUT/ended"
cp -r "$MNT/run" "$OUT/run"
"""


def disk_full(layout: list[str], tmp: Path) -> Outcome:
    out, mnt = tmp / "out", tmp / "mnt"
    out.mkdir()
    mnt.mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "PY": sys.executable, "MNT": str(mnt),
           "OUT": str(out), "ARGS": " ".join([*layout, *BASE])}
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", _FILL], env=env,
                           cwd=tmp, timeout=300)
    if probe.returncode == 99 or not (out / "exit").exists():
        return Outcome(None, 0.0, True, "n/a: no tmpfs mount here (tests/test_resume.py stubs ENOSPC)")
    code = int((out / "exit").read_text())
    seconds = float((out / "ended").read_text()) - float((out / "filled").read_text())
    err = (out / "stderr").read_text()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    ok = code == 1 and len(errors) == 1 and "No space left" in errors[0] and "summary" in rows[-1] \
        and (out / "run" / "checkpoint.pt").exists() and "Traceback" not in err
    return Outcome(code, seconds, ok, "one ENOSPC line; summary row and checkpoint written")


def kill_resume(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, "trainer.total_frames=16000", "checkpoint.interval=1"], tmp / "run")
    run.wait_rows(3)
    deadline = time.monotonic() + 60
    while not (run.run_dir / "checkpoint.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(run.proc.pid, signal.SIGKILL)
    run.finish()
    resumed = Run([f"resume={run.run_dir}"], run.run_dir, set_dir=False)
    code = resumed.finish()
    rows = run.rows()
    frames = [r["frames"] for r in rows if "summary" not in r]
    final = rows[-1].get("summary", {}).get("frames") if rows else None
    ok = code == 0 and frames == sorted(frames) and final == 16000
    return Outcome(code, time.monotonic() - resumed.started, ok,
                   f"resumed to {final} frames, frame column monotonic: {frames == sorted(frames)}")


def same_second(layout: list[str], tmp: Path) -> Outcome:
    args = [*layout, "trainer.total_frames=512", "trainer.target_return=null", "logger=jsonl", "progress=false"]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline", *args, f"seed={s}"], cwd=tmp, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for s in (1, 2)]
    codes = [p.wait(timeout=300) for p in procs]
    dirs = sorted(p.parent for p in tmp.glob("runs/*/*/metrics.jsonl"))
    return Outcome(max(codes), time.monotonic() - started, codes == [0, 0] and len(dirs) == 2,
                   f"two runs launched together: {len(dirs)} directories")


def _until(run: Run, key: str, since: float, timeout: float = 60.0) -> float:
    """Seconds from ``since`` until a metrics row shows ``key`` >= 1 (nan if it never does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        if _max(run, key) >= 1:
            return time.monotonic() - since
        time.sleep(0.05)
    return float("nan")


def _frozen(run: Run, pid: int, key: str) -> tuple[int | None, float, float]:
    """SIGSTOP ``pid``; the run's exit code, seconds until ``key`` counted the restart, and that count."""
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        seconds = _until(run, key, stopped)
        code = run.finish()
    finally:
        try:  # never leave a stopped process behind, whatever the runner did
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, seconds, _max(run, key)


def sigstop_worker(layout: list[str], tmp: Path) -> Outcome:
    if "workers=process" not in layout:
        return Outcome(None, 0.0, True, "n/a: thread workers (a frozen thread is the `hang` rows)")
    run = Run([*layout, *BASE, "workers.step_timeout=3", "trainer.total_frames=30000"], tmp / "run")
    run.wait_rows(2)
    code, seconds, restarts = _frozen(run, run.children()[-1], "collector/worker_restarts")
    frames = _summary(run).get("frames")
    ok = code == 0 and restarts == 1 and frames == 30000 and seconds <= 3 + 2
    return Outcome(code, seconds, ok, f"frozen worker restarted after {seconds:.1f} s; {frames} frames")


def sigstop_server(layout: list[str], tmp: Path) -> Outcome:
    if "server=process" not in layout:
        return Outcome(None, 0.0, True, "n/a: the server is a thread of the runner")
    run = Run([*layout, *BASE, "server.step_timeout=3", "server.max_restarts=1", "trainer.total_frames=30000"],
              tmp / "run")
    run.wait_rows(2)
    code, seconds, restarts = _frozen(run, run.children()[0], "collector/server_restarts")
    frames = _summary(run).get("frames")
    ok = code == 0 and restarts == 1 and frames == 30000 and seconds <= 3 + 2
    return Outcome(code, seconds, ok, f"frozen server restarted after {seconds:.1f} s; {frames} frames")


_PAYLOAD = "import os, pickle, sys\nclass P:\n    def __reduce__(self):\n        return (os.system, (f'touch {sys.argv[2]}',))\n" \
           "open(sys.argv[1], 'wb').write(pickle.dumps(P()))\n"


def crafted_resume(layout: list[str], tmp: Path) -> Outcome:
    """A run directory whose overrides would unpickle a planted file on ``resume=``: refused, nothing runs."""
    run = Run([*layout, *BASE, "trainer.total_frames=1024"], tmp / "run")
    if run.finish() != 0:
        return Outcome(run.proc.returncode, 0.0, False, "the run to craft did not finish")
    payload, marker = run.run_dir / "payload.pkl", tmp / "PWNED"
    subprocess.run([sys.executable, "-c", _PAYLOAD, str(payload), str(marker)], check=True, timeout=60)
    overrides = run.run_dir / ".hydra" / "overrides.yaml"
    overrides.write_text(overrides.read_text() + f"- env.factory._target_=torch.load\n- +env.factory.f={payload}\n"
                         "- +env.factory.weights_only=false\n")
    resumed = Run([f"resume={run.run_dir}"], run.run_dir, set_dir=False)
    code = resumed.finish()
    lines = [line for line in resumed.err.splitlines() if line.strip()]
    ok = code == 2 and len(lines) == 1 and "_target_" in lines[0] and not marker.exists()
    return Outcome(code, time.monotonic() - resumed.started, ok,
                   f"payload ran: {marker.exists()}; " + (lines[-1][:90] if lines else "no error line"))


BLOCKING_SINK = ["logger.extra_sinks=[tests.blocking_sink.BlockingSink]", "logger.queue_rows=8",
                 "logger.wandb_timeout=3"]


def _blocked_rows(run: Run, timeout: float = 120.0) -> None:
    """Until the sink is stuck and its queue full (a row counts a dropped row)."""
    deadline = time.monotonic() + timeout
    while _max(run, "logger/dropped_rows") < 1 and time.monotonic() < deadline and run.proc.poll() is None:
        time.sleep(0.05)


def blocked_sink(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, *BLOCKING_SINK, "logger.rows_per_run=400", "trainer.total_frames=40000"],
              tmp / "run")  # rows enough to fill the pipe and the queue behind the stuck sink
    code = run.finish()
    summary = _summary(run)
    warned = sum(line.startswith("warning: logger sink") for line in run.err.splitlines())
    ok = code == 0 and summary.get("frames") == 40000 and summary.get("logger/dropped_rows", 0) > 0 \
        and warned == 2 and (run.run_dir / "checkpoint.pt").exists() and "Traceback" not in run.err
    return Outcome(code, time.monotonic() - run.started, ok,
                   f"{summary.get('logger/dropped_rows')} rows dropped for the stuck sink, {summary.get('frames')} frames")


def blocked_sink_sigint(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, *BLOCKING_SINK, "trainer.total_frames=2000000"], tmp / "run")
    _blocked_rows(run)
    os.killpg(run.proc.pid, signal.SIGINT)
    sent = time.monotonic()
    code = run.finish()
    seconds = time.monotonic() - sent
    summary = _summary(run)
    ok = code == 130 and summary.get("stop_reason", "").startswith("interrupted") and seconds < 10 \
        and (run.run_dir / "checkpoint.pt").exists() and "Traceback" not in run.err
    return Outcome(code, seconds, ok, f"summary '{summary.get('stop_reason')}', checkpoint written, sink abandoned")

SPEC = ["env.factory._target_=tests.fakes.SpecBreakingEnvFactory", "+env.factory.at_step=30", "transport=slots"]


def spec_shape(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, *SPEC, "+env.factory.fault=obs_shape", "workers.max_restarts=0",
               "trainer.total_frames=20000"], tmp / "run")
    code = run.finish()
    errors = run.errors()
    ok = code == 1 and len(errors) == 1 and "broke its spec" in errors[0] and "promises shape (4,)" in errors[0]
    return Outcome(code, time.monotonic() - run.started, ok, errors[0][-90:] if errors else "no error line")


def spec_reward_once(layout: list[str], tmp: Path) -> Outcome:
    run = Run([*layout, *BASE, *SPEC, "+env.factory.fault=reward_2", f"+env.factory.once={tmp / 'm'}",
               "workers.max_restarts=1", "trainer.total_frames=4000"], tmp / "run")
    code = run.finish()
    frames, restarts = _summary(run).get("frames"), _max(run, "collector/worker_restarts")
    return Outcome(code, time.monotonic() - run.started, code == 0 and frames == 4000 and restarts == 1,
                   f"a (2,) reward once: restarted ({restarts:g}), {frames} frames")

SCENARIOS: dict[str, Callable[[list[str], Path], Outcome]] = {
    "crash": crash_restart, "crash-repeated": crash_repeated, "hang": hang, "kill-worker": kill_worker,
    "kill-server": kill_server, "kill-server-no-restart": kill_server_no_restart,
    "sigint-mid-run": sigint_mid_run, "sigterm-mid-run": sigterm_mid_run, "sigint-start-up": sigint_start_up,
    "nan": nan_error, "nan-skip": nan_skip, "disk-full": disk_full, "kill-resume": kill_resume,
    "same-second": same_second, "sigstop-worker": sigstop_worker, "sigstop-server": sigstop_server,
    "crafted-resume": crafted_resume, "blocked-sink": blocked_sink, "blocked-sink-sigint": blocked_sink_sigint,
    "spec-shape": spec_shape, "spec-reward-once": spec_reward_once,
}


def main(argv: list[str]) -> int:
    chosen = argv or list(SCENARIOS)
    unknown = [name for name in chosen if name not in SCENARIOS]
    if unknown:
        print(f"error: unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    print("| scenario | workers/server | exit | s | left (procs, /dev/shm) | verdict |")
    print("|---|---|---|---|---|---|")
    failed = 0
    for name in chosen:
        for layout_name, layout in LAYOUTS.items():
            before = set(os.listdir("/dev/shm"))
            RUNS.clear()
            with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-") as tmp:
                try:
                    outcome = SCENARIOS[name](layout, Path(tmp))
                except Exception as err:  # noqa: BLE001 - a broken scenario is a failed row, not a stop
                    outcome = Outcome(None, 0.0, False, f"{type(err).__name__}: {err}")
            time.sleep(0.5)
            shm = len(set(os.listdir("/dev/shm")) - before)
            procs = sum(run.left_behind() for run in RUNS)
            ok = outcome.ok and shm == 0 and procs == 0
            failed += not ok
            code = "-" if outcome.code is None else str(outcome.code)
            print(f"| {name} | {layout_name} | {code} | {outcome.seconds:.1f} | {procs}, {shm} | "
                  f"{'PASS' if ok else 'FAIL'}: {outcome.detail} |", flush=True)
            if not ok:  # what the failed row's runs said, for whoever reads the table
                for run in RUNS:
                    tail = [line for line in run.err.splitlines() if line.strip()][-5:]
                    print(f"{name} {layout_name}: " + " | ".join(tail), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
