"""Many ``python -m pipeline`` runs for the price of one interpreter start.

A config-error case spends ~2.5 s starting Python and importing Hydra,
torch and the runner, and well under one second on what it tests. This
helper starts one interpreter, imports all that once, and forks a child
per case that runs the real entry point (``pipeline.__main__.main``) with
the case's argv, working directory and environment, its stdout and
stderr in files: the same exit code, the same two streams, the same
``leave`` at the end as a fresh ``python -m pipeline``. Nothing threaded
has started when the children fork (the parent only imported modules).

Run as a script by :func:`run_forked`; it reads the cases as JSON on
stdin and writes the results as JSON on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: seconds one forked case may take before it is killed (and reported as exit -9)
CASE_TIMEOUT_S = 120.0


def run_forked(cases: list[list[str]], cwd: Path, env: dict[str, str], timeout: float = 900.0,
               parallel: int | None = None) -> list[dict[str, Any]]:
    """``[{"returncode", "stdout", "stderr"}]`` for each argv in ``cases``, in order."""
    request = {"cases": cases, "cwd": str(cwd), "env": env, "parallel": parallel or max(1, os.cpu_count() or 1)}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve())], input=json.dumps(request), cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the forking runner failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _child(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked child: become ``python -m pipeline *args`` and never return."""
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        import pipeline.__main__ as entry

        sys.argv = [str(entry.__file__), *args]  # what `python -m pipeline` puts there
        entry.main()
    except SystemExit as exit_:
        os._exit(exit_.code if isinstance(exit_.code, int) else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the parent's loop
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _serve(request: dict[str, Any]) -> list[dict[str, Any]]:
    import hydra  # noqa: F401 - imported once here, inherited by every child
    import omegaconf  # noqa: F401

    import pipeline.__main__  # noqa: F401
    import pipeline.runner.run  # noqa: F401 - the runner and what it imports (torch)
    import pipeline.plan.validate  # noqa: F401

    cases: list[list[str]] = request["cases"]
    results: list[dict[str, Any] | None] = [None] * len(cases)
    running: dict[int, tuple[int, float, str, str]] = {}  # pid -> (case, started, out, err)
    scratch = tempfile.mkdtemp(prefix="cli-forks-")
    pending = list(range(len(cases)))
    while pending or running:
        while pending and len(running) < int(request["parallel"]):
            index = pending.pop(0)
            out, err = os.path.join(scratch, f"{index}.out"), os.path.join(scratch, f"{index}.err")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(cases[index], request["cwd"], request["env"], out, err)
            running[pid] = (index, time.monotonic(), out, err)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for child, (_, started, _, _) in running.items():
                if time.monotonic() - started > CASE_TIMEOUT_S:
                    os.kill(child, 9)
            time.sleep(0.01)
            continue
        if pid not in running:
            continue
        index, _, out, err = running.pop(pid)
        results[index] = {"returncode": os.waitstatus_to_exitcode(status),
                          "stdout": Path(out).read_text(errors="replace"),
                          "stderr": Path(err).read_text(errors="replace")}
    missing = [cases[i] for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"no result for {missing}")
    return [r for r in results if r is not None]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    answer = _serve(json.loads(sys.stdin.read()))
    sys.stdout.write(json.dumps(answer))
