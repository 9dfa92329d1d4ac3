"""TensorBoard event files in ``<run dir>/tb``: the same keys as the JSONL rows.

Scalars are logged against frames; the resolved config goes in as text at
the start; at the end ``hparams`` summaries (the run's overrides against
its final metrics) are written into the same event stream, so
``tensorboard --logdir <sweep dir>`` compares a sweep's points in its
HParams tab.

Written with the ``tensorboard`` package's own event writer and protocol
buffers, not ``torch.utils.tensorboard``: that wrapper imports torch, about
1.2 s of CPU in the sink process while the run starts, on a machine whose
few cores the trainer and the env workers need then; what it would add
here (building three protos) is a few lines.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

#: Final-summary keys shown as HParams metrics (under ``hparam/``).
HPARAM_METRICS = ("episode/return_mean", "wall_time_s", "frames", "collector/frames_per_s")


def _hparam_value(value: Any) -> bool | int | float | str:
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _text_summary(tag: str, text: str) -> Any:
    """What TensorBoard's text plugin reads: a one-element string tensor under ``<tag>/text_summary``."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.text import metadata

    tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    return Summary(value=[Summary.Value(tag=f"{tag}/text_summary", metadata=metadata.create_summary_metadata("", ""),
                                        tensor=tensor)])


def _hparams_summaries(hparams: dict[str, bool | int | float | str], metrics: list[str]) -> list[Any]:
    """The HParams plugin's experiment, session-start and session-end summaries for one run."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo()
    infos = []
    for name, value in hparams.items():
        if isinstance(value, bool):  # before int: a bool is an int to Python
            start.hparams[name].bool_value, kind = value, "DATA_TYPE_BOOL"
        elif isinstance(value, (int, float)):
            start.hparams[name].number_value, kind = float(value), "DATA_TYPE_FLOAT64"
        else:
            start.hparams[name].string_value, kind = str(value), "DATA_TYPE_STRING"
        infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind)))
    experiment = api_pb2.Experiment(hparam_infos=infos,
                                    metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=m)) for m in metrics])
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value("STATUS_SUCCESS"))
    out = []
    for tag, data in ((metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)),
                      (metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=start)),
                      (metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end))):
        out.append(Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))]))
    return out


def _mp4_fps(path: str, default: int) -> int:
    import imageio.v2 as imageio

    try:
        reader = imageio.get_reader(path, format="FFMPEG")
        try:
            return max(1, int(round(float(reader.get_meta_data().get("fps", default)))))
        finally:
            reader.close()
    except Exception:  # noqa: BLE001 - the GIF's speed only
        return default


def _gif_size(gif: bytes) -> tuple[int, int]:
    """(height, width) from a GIF's logical screen descriptor (bytes 6-9, little-endian width then height)."""
    return int.from_bytes(gif[8:10], "little"), int.from_bytes(gif[6:8], "little")


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, run_dir: Path, *, config_text: str | None = None,
                 hparams: dict[str, Any] | None = None) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = run_dir / "tb"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.log_dir), flush_secs=10)
        self._hparams = {k: _hparam_value(v) for k, v in (hparams or {}).items()}
        self._last: dict[str, float] = {}
        if config_text:
            # Markdown code block: TensorBoard's text plugin renders markdown.
            self._add(_text_summary("config", "```\n" + config_text + "\n```"), 0)

    def _add(self, summary: Any, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._writer.add_event(Event(summary=summary, step=int(step), wall_time=time.time()))

    def _scalars(self, values: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        if values:
            self._add(Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()]), step)

    def log(self, row: dict[str, Any], frames: int) -> None:
        values = {key: float(value) for key, value in row.items()
                  if key != "frames" and value is not None and not isinstance(value, (str, bool))}
        self._scalars(values, frames)
        self._last.update(values)
        self._writer.flush()

    def video(self, tag: str, path: str, frames: int) -> None:
        """The video as an animated GIF image summary: what ``SummaryWriter.add_video`` writes, shown in the
        Images dashboard (scaled down: TensorBoard keeps the whole GIF in the event file)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        from components.video import gif_bytes, read_mp4

        images = read_mp4(Path(path))
        gif = gif_bytes(images, fps=_mp4_fps(path, 30))
        height, width = _gif_size(gif)
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif)
        self._add(Summary(value=[Summary.Value(tag=tag, image=image)]), frames)
        self._writer.flush()

    def summary(self, values: dict[str, Any]) -> None:
        metrics = {f"hparam/{k}": float(v) for k, v in {**self._last, **values}.items()
                   if k in HPARAM_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not metrics:
            return
        for summary in _hparams_summaries(self._hparams or {"run": "default"}, list(metrics)):
            self._add(summary, 0)
        self._scalars(metrics, int(values.get("frames", 0) or 0))
        self._writer.flush()

    def close(self, exit_code: int) -> None:
        self._writer.close()
