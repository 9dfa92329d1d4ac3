"""A wandb run per job, opened and finished in the driver only.

Offline unless ``mode`` or ``$WANDB_MODE`` says otherwise; its files live in
``<run dir>/wandb``. Sweep jobs share a ``group`` (the sweep directory's
name), carry ``job_type`` and their overrides as tags, so the wandb UI
groups a sweep's points. A resumed run continues its wandb run
(``resume="allow"`` with the saved id).

wandb talks to a service process and, online, to a server: either can be
missing, slow or broken. ``wandb.init`` is bounded by ``init_timeout`` and
``finish`` by ``finish_timeout`` (it runs in a daemon thread), so neither
can hang a run; the caller (:class:`~components.metrics.MetricsLogger`)
turns any exception into one warning and goes on without this sink.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any


class WandbSink:
    name = "wandb"

    def __init__(self, run_dir: Path, *, project: str, entity: str | None = None, group: str | None = None,
                 name: str | None = None, tags: list[str] | None = None, job_type: str | None = None,
                 mode: str | None = None, run_config: dict[str, Any] | None = None,
                 resume_id: str | None = None, init_timeout: float = 60.0, finish_timeout: float = 60.0) -> None:
        import wandb

        self.finish_timeout = finish_timeout
        # wandb limits a tag to 64 characters
        clean_tags = [t[:64] for t in (tags or []) if t]
        self.run = wandb.init(
            project=project, entity=entity, group=group, name=name, tags=clean_tags, job_type=job_type,
            dir=str(run_dir), mode=mode or os.environ.get("WANDB_MODE") or "offline",
            config=dict(run_config or {}), id=resume_id, resume="allow" if resume_id else None,
            settings=wandb.Settings(silent=True, console="off", init_timeout=init_timeout),
        )
        if self.run is None:
            raise RuntimeError("wandb.init returned no run")

    @property
    def id(self) -> str:
        return self.run.id

    @property
    def dir(self) -> Path:
        return Path(self.run.dir).parent

    def log(self, row: dict[str, Any], frames: int) -> None:
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log(numeric, step=int(frames))

    def video(self, tag: str, path: str, frames: int) -> None:
        """The mp4 as a ``wandb.Video`` (copied into the run's media files: offline runs keep it too)."""
        import wandb

        self.run.log({tag: wandb.Video(path, format="mp4")}, step=int(frames))

    def summary(self, values: dict[str, Any]) -> None:
        self.run.summary.update(values)

    def close(self, exit_code: int) -> None:
        errors: list[BaseException] = []

        def finish() -> None:
            try:
                self.run.finish(exit_code=exit_code)
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        thread = threading.Thread(target=finish, name="wandb-finish", daemon=True)
        thread.start()
        thread.join(self.finish_timeout)
        if thread.is_alive():
            raise TimeoutError(f"wandb.finish did not return within {self.finish_timeout:g} s")
        if errors:
            raise errors[0]
