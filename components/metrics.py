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
        wandb_timeout: seconds wandb may take to start, and to finish.

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
    ) -> None:
        self.sinks_requested = check_sinks(sinks)
        self.interval = interval
        self.rows_per_run = rows_per_run
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = JsonLinesSink(self.run_dir)
        self._optional: list[Sink] = []
        self._wandb: Any = None
        given = list(overrides or [])
        if "tensorboard" in self.sinks_requested:
            self._open("tensorboard", lambda: self._tensorboard(run_config, given))
        if "wandb" in self.sinks_requested:
            from components.sinks.wandb_run import WandbSink

            self._wandb = self._open("wandb", lambda: WandbSink(
                self.run_dir, project=project, entity=entity, group=group, name=name,
                tags=[*(tags or []), *given], job_type=job_type, mode=mode,
                run_config=dict(run_config or {}), resume_id=resume_id, init_timeout=wandb_timeout,
                finish_timeout=wandb_timeout))

    def _tensorboard(self, run_config: Mapping[str, Any] | None, overrides: list[str]) -> Sink:
        from components.sinks.tensorboard import TensorBoardSink

        text = None
        if run_config:
            from omegaconf import OmegaConf

            text = OmegaConf.to_yaml(OmegaConf.create(dict(run_config)))
        return TensorBoardSink(self.run_dir, config_text=text, hparams=overrides_dict(overrides) or {"run": "default"})

    def _open(self, name: str, make: Any) -> Any:
        try:
            sink = make()
        except Exception as err:  # noqa: BLE001 - an optional view: say so once, go on without it
            self._warn(name, "could not start", err)
            return None
        self._optional.append(sink)
        return sink

    @staticmethod
    def _warn(name: str, what: str, err: BaseException) -> None:
        detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(f"warning: logger sink {name} {what} ({type(err).__name__}: {detail}); "
              "the run goes on without it", file=sys.stderr, flush=True)

    def _each(self, call: str, *args: Any) -> None:
        for sink in list(self._optional):
            try:
                getattr(sink, call)(*args)
            except Exception as err:  # noqa: BLE001 - see the module docstring
                self._optional.remove(sink)
                if sink is self._wandb:
                    self._wandb = None
                self._warn(sink.name, "failed", err)

    @property
    def sinks(self) -> list[str]:
        """The sinks that are writing now (a failed optional one is gone)."""
        return ["jsonl", *[s.name for s in self._optional]]

    @property
    def wandb_id(self) -> str | None:
        """The wandb run's id (what a resumed run continues), None without wandb."""
        return self._wandb.id if self._wandb is not None else None

    @property
    def wandb_dir(self) -> Path | None:
        return self._wandb.dir if self._wandb is not None else None

    @property
    def tensorboard_dir(self) -> Path | None:
        return next((s.log_dir for s in self._optional if s.name == "tensorboard"), None)  # type: ignore[attr-defined]

    def log(self, metrics: Mapping[str, Any], *, frames: int) -> None:
        row = {"frames": int(frames), **{k: _clean(v) for k, v in metrics.items()}}
        self._jsonl.log(row, int(frames))  # first: its errors end the run
        self._each("log", row, int(frames))

    def summary(self, values: Mapping[str, Any]) -> None:
        """Final values: a last ``summary`` row in the file, the wandb run summary, TensorBoard HParams."""
        clean = {k: _clean(v) for k, v in values.items()}
        self._jsonl.summary(clean)
        self._each("summary", clean)

    def close(self, exit_code: int = 0) -> None:
        try:
            self._each("close", exit_code)
        finally:
            self._optional.clear()
            self._wandb = None
            self._jsonl.close(exit_code)
