"""The metrics logger: one call per row, fanned out to every configured sink.

Every logged row is a flat dict of numbers keyed ``group/name``
(``train/policy_loss``, ``server/avg_batch_size``, ...) plus ``frames`` and
``time``. Sinks (:mod:`components.sinks`): ``metrics.jsonl`` (always: the
report, the tests and resume read it), TensorBoard event files in
``<run dir>/tb`` and a wandb run in ``<run dir>/wandb``.

Only ``metrics.jsonl`` may stop a run (a write error there is the run
directory failing, e.g. a full disk). TensorBoard and wandb are optional
views: an exception in one of them (no network, a bad key, a crash inside
wandb, a full disk under its files) is one warning line, and the other
sinks go on.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from components.sinks import SINK_NAMES, Sink
from components.sinks.jsonl import JsonLinesSink

#: The default sinks (``logger.sinks``).
DEFAULT_SINKS = ("jsonl", "tensorboard", "wandb")


def _clean(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, str)):
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f if math.isfinite(f) else None


def check_sinks(sinks: Sequence[str]) -> list[str]:
    """The sinks to open, ``jsonl`` first and always; ValueError for an unknown or repeated one."""
    names = [str(s) for s in sinks]
    unknown = [s for s in names if s not in SINK_NAMES]
    if unknown:
        raise ValueError(f"unknown sink(s) {unknown}; choose from {list(SINK_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a sink is listed twice: {names}")
    return ["jsonl", *[s for s in names if s != "jsonl"]]


def overrides_dict(overrides: Sequence[str]) -> dict[str, str]:
    """``["trainer.lr=0.001", "seed=1"]`` -> ``{"trainer.lr": "0.001", "seed": "1"}`` (Hydra's own keys left out)."""
    out = {}
    for item in overrides:
        key, sep, value = str(item).partition("=")
        key = key.lstrip("+~")
        if sep and not key.startswith("hydra.") and key != "resume":
            out[key] = value
    return out


def _config_text(run_config: Mapping[str, Any] | None) -> str | None:
    if not run_config:
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(dict(run_config)))


class SinkStartError(RuntimeError):
    """An optional sink opened in the background could not start."""


class BackgroundOpen:
    """An optional sink opened in a daemon thread, so its start is off the run's critical path.

    ``wandb.init`` takes about 2 s even offline (imports, a service process,
    its settings model); a run that waited for it would train 2 s later.
    Rows and summaries given before the sink is open are kept and replayed
    in order on the first call after it is (from the caller's thread: the
    sink is never used from two threads). ``close`` and the sink's own
    attributes (``id``, ``dir``) wait for the start, at most ``timeout``.
    A start that failed raises :class:`SinkStartError` from the next call.
    """

    def __init__(self, name: str, make: Any, timeout: float) -> None:
        self.name = name
        self._timeout = timeout
        self._sink: Any = None
        self._error: BaseException | None = None
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._ready = threading.Event()

        def open_it() -> None:
            try:
                self._sink = make()
            except BaseException as err:  # noqa: BLE001 - raised from the next call
                self._error = err
            finally:
                self._ready.set()

        threading.Thread(target=open_it, name=f"open-{name}", daemon=True).start()

    def _resolve(self, wait: bool) -> Any:
        if not self._ready.is_set() and not (wait and self._ready.wait(self._timeout)):
            if wait:
                raise SinkStartError(f"did not start within {self._timeout:g} s")
            return None
        if self._error is not None:
            raise SinkStartError(f"{type(self._error).__name__}: {self._error}") from self._error
        pending, self._pending = self._pending, []
        for call, args in pending:
            getattr(self._sink, call)(*args)
        return self._sink

    def _call(self, call: str, *args: Any) -> None:
        sink = self._resolve(wait=False)
        if sink is None:
            self._pending.append((call, args))
        else:
            getattr(sink, call)(*args)

    def log(self, row: dict[str, Any], frames: int) -> None:
        self._call("log", row, frames)

    def summary(self, values: dict[str, Any]) -> None:
        self._call("summary", values)

    def close(self, exit_code: int) -> None:
        self._resolve(wait=True).close(exit_code)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._resolve(wait=True), name)


class MetricsLogger:
    """Writes metric rows to ``metrics.jsonl`` and the other ``sinks``.

    Args:
        run_dir: the run directory (every sink writes below it).
        sinks: of ``jsonl``, ``tensorboard``, ``wandb`` (``jsonl`` is added
            when missing).
        interval: seconds between rows (read by the runner's reporter).
        rows_per_run: rows spread over the budget at least (0: only every
            ``interval``), so a short run still draws a curve.
        project, entity, group, name, tags, job_type, mode: the wandb run's.
        run_config: the resolved config (wandb config, TensorBoard text).
        overrides: the job's command-line overrides (wandb tags, TensorBoard
            HParams).
        resume_id: the wandb run id to continue.
        wandb_timeout: seconds wandb may take to start, and the sinks
            process to take the summary and close every sink at the end
            (wandb's finish included): past it, the process is killed and the
            run ends without it.
        extra_sinks: ``module.Class`` paths of more sinks, each built as
            ``Class(run_dir)`` in the sinks process (whatever ``in_process``
            says) and given every row, the summary and the close, like
            TensorBoard (see :class:`components.sinks.Sink`).
        queue_rows: rows the sinks process may fall behind; past it rows are
            dropped for those sinks (``metrics.jsonl`` keeps every row), said
            once and counted in ``logger/dropped_rows``.
        in_process: open TensorBoard and wandb in this process (default) or,
            with False, in a child process (:mod:`components.sinks.host`;
            the runner's choice: their Python then never takes this
            process's GIL from training).

    Examples:
        >>> import tempfile, json
        >>> d = Path(tempfile.mkdtemp())
        >>> log = MetricsLogger(d, sinks=["jsonl"])
        >>> log.log({"train/loss": 0.5}, frames=100)
        >>> log.close()
        >>> json.loads((d / "metrics.jsonl").read_text())["train/loss"]
        0.5
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        sinks: Sequence[str] = DEFAULT_SINKS,
        interval: float = 5.0,
        rows_per_run: int = 50,
        project: str = "rlpipeline",
        entity: str | None = None,
        group: str | None = None,
        name: str | None = None,
        tags: Sequence[str] | None = None,
        job_type: str | None = None,
        mode: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        overrides: Sequence[str] | None = None,
        resume_id: str | None = None,
        wandb_timeout: float = 60.0,
        in_process: bool = True,
        extra_sinks: Sequence[str] = (),
        queue_rows: int = 256,
    ) -> None:
        self.sinks_requested = check_sinks(sinks)
        self.interval = interval
        self.rows_per_run = rows_per_run
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = JsonLinesSink(self.run_dir)
        self._optional: list[Sink] = []
        self._wandb: Any = None
        self._host: Any = None
        self._hosts_builtin = not in_process  # TensorBoard and wandb live in the sinks process
        self._wandb_timeout = wandb_timeout
        given = list(overrides or [])
        optional = [s for s in self.sinks_requested if s != "jsonl"]
        extra = [str(path) for path in extra_sinks]
        if (optional and not in_process) or extra:
            from components.sinks.host import SinkHost

            specs = []
            if "tensorboard" in optional and not in_process:
                specs.append(("tensorboard", "components.sinks.tensorboard.TensorBoardSink", (self.run_dir,),
                              {"config_text": _config_text(run_config),
                               "hparams": overrides_dict(given) or {"run": "default"}}))
            if "wandb" in optional and not in_process:
                specs.append(("wandb", "components.sinks.wandb_run.WandbSink", (self.run_dir,), dict(
                    project=project, entity=entity, group=group, name=name, tags=[*(tags or []), *given],
                    job_type=job_type, mode=mode, run_config=dict(run_config or {}), resume_id=resume_id,
                    init_timeout=wandb_timeout, finish_timeout=wandb_timeout)))
            specs += [(path, path, (self.run_dir,), {}) for path in extra]
            self._host = SinkHost(specs, queue_rows=queue_rows)
            if not in_process:
                return
        if "tensorboard" in self.sinks_requested:
            self._open("tensorboard", lambda: self._tensorboard(run_config, given))
        if "wandb" in self.sinks_requested:
            from components.sinks.wandb_run import WandbSink

            self._wandb = self._open_in_background("wandb", wandb_timeout, lambda: WandbSink(
                self.run_dir, project=project, entity=entity, group=group, name=name,
                tags=[*(tags or []), *given], job_type=job_type, mode=mode,
                run_config=dict(run_config or {}), resume_id=resume_id, init_timeout=wandb_timeout,
                finish_timeout=wandb_timeout))

    def _tensorboard(self, run_config: Mapping[str, Any] | None, overrides: list[str]) -> Sink:
        from components.sinks.tensorboard import TensorBoardSink

        return TensorBoardSink(self.run_dir, config_text=_config_text(run_config),
                               hparams=overrides_dict(overrides) or {"run": "default"})

    def _open(self, name: str, make: Any) -> Any:
        try:
            sink = make()
        except Exception as err:  # noqa: BLE001 - an optional view: say so once, go on without it
            self._warn(name, "could not start", err)
            return None
        self._optional.append(sink)
        return sink

    def _open_in_background(self, name: str, timeout: float, make: Any) -> Any:
        sink = BackgroundOpen(name, make, timeout)
        self._optional.append(sink)
        return sink

    @staticmethod
    def _warn(name: str, what: str, err: BaseException) -> None:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"warning: logger sink {name} {what} ({type(err).__name__}: {detail}); "
              "the run goes on without it", file=sys.stderr, flush=True)

    def _each(self, call: str, *args: Any) -> None:
        for sink in list(self._optional):
            self._each_one(sink, call, *args)

    def _each_one(self, sink: Any, call: str, *args: Any) -> None:
        try:
            getattr(sink, call)(*args)
        except Exception as err:  # noqa: BLE001 - see the module docstring
            self._optional.remove(sink)
            if sink is self._wandb:
                self._wandb = None
            self._warn(sink.name, "could not start" if isinstance(err, SinkStartError) else "failed", err)

    @property
    def sinks(self) -> list[str]:
        """The sinks that are writing now (a failed optional one is gone)."""
        hosted = self._host.names if self._host is not None else []
        return ["jsonl", *[s.name for s in self._optional], *hosted]

    @property
    def wandb_id(self) -> str | None:
        """The wandb run's id (what a resumed run continues), None without wandb (or when it did not start)."""
        return self._wandb_attr("id")

    @property
    def wandb_dir(self) -> Path | None:
        return self._wandb_attr("dir")

    def _wandb_attr(self, name: str) -> Any:
        if self._host is not None and self._hosts_builtin:
            value = self._host.attr("wandb", name, self._wandb_timeout)
            return None if value is None else (Path(value) if name == "dir" else value)
        if self._wandb is None:
            return None
        try:
            return getattr(self._wandb, name)
        except Exception as err:  # noqa: BLE001 - it failed to start: warned once, gone
            if self._wandb in self._optional:
                self._optional.remove(self._wandb)
                self._warn("wandb", "could not start" if isinstance(err, SinkStartError) else "failed", err)
            self._wandb = None
            return None

    @property
    def tensorboard_dir(self) -> Path | None:
        if self._host is not None and self._hosts_builtin:
            value = self._host.attr("tensorboard", "log_dir", 30.0)
            return None if value is None else Path(value)
        return next((s.log_dir for s in self._optional if s.name == "tensorboard"), None)  # type: ignore[attr-defined]

    def log(self, metrics: Mapping[str, Any], *, frames: int) -> None:
        row = {"frames": int(frames), **{k: _clean(v) for k, v in metrics.items()}}
        if self._host is not None:  # rows the sinks process did not get, up to this one
            row["logger/dropped_rows"] = self._host.dropped
        self._jsonl.log(row, int(frames))  # first: its errors end the run
        self._each("log", row, int(frames))
        if self._host is not None:
            self._host.send("log", row, int(frames))

    def video(self, tag: str, path: Path, frames: int) -> None:
        """A video file (``<run dir>/videos/*.mp4``, already written) for the sinks that show videos.

        ``metrics.jsonl`` keeps no media (the report finds the files); TensorBoard, wandb and any extra sink
        with a ``video(tag, path, frames)`` method get it; a sink without one is skipped, not failed.
        """
        for sink in list(self._optional):
            if hasattr(sink, "video"):
                self._each_one(sink, "video", tag, str(path), int(frames))
        if self._host is not None:
            self._host.send("video", tag, str(path), int(frames))

    def summary(self, values: Mapping[str, Any]) -> None:
        """Final values: a last ``summary`` row in the file, the wandb run summary, TensorBoard HParams."""
        clean = {k: _clean(v) for k, v in values.items()}
        if self._host is not None:
            clean["logger/dropped_rows"] = self._host.dropped
        self._jsonl.summary(clean)
        self._each("summary", clean)
        if self._host is not None:
            self._host.summary(clean)  # never waited for here: close gives it its time

    def close(self, exit_code: int = 0) -> None:
        try:
            self._each("close", exit_code)
            if self._host is not None:
                self._host.close(exit_code, self._wandb_timeout)
        finally:
            self._host = None
            self._optional.clear()
            self._wandb = None
            self._jsonl.close(exit_code)
