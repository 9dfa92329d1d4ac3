"""Videos of an agent: envs that render RGB frames, and frames to mp4 and GIF.

The encoder is imageio with its ``imageio-ffmpeg`` plugin, which ships a
static ffmpeg binary in its wheel: no system ffmpeg is assumed, and the
files are H.264 in mp4 (``yuv420p``, ``+faststart``), which browsers,
wandb and every video player play. GIFs (what TensorBoard's image
dashboard animates) are written by Pillow through imageio.

Frames come from ``env.render()`` of envs made with
``render_mode="rgb_array"``; for Atari that is the emulator's RGB screen,
not the 84x84 grey stack the policy sees.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


class VideoError(RuntimeError):
    """A video cannot be made (an env that does not render, a missing encoder); one line for the user."""


def render_factory(factory: Any) -> Any:
    """``factory`` building envs with ``render_mode="rgb_array"``; the envs step exactly as the original's.

    Works for the built-in factories (and any dataclass factory with a ``kwargs`` field given to
    ``gym.make``) and env sets of them; anything else is a :class:`VideoError` naming it.
    """
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame draws off-screen: no display, no XDG warning
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        os.environ.setdefault("MUJOCO_GL", "egl")  # headless MuJoCo: GLFW needs a display, EGL does not
    entries = getattr(factory, "entries", None)
    if entries is not None and hasattr(factory, "cycle"):  # an env set: each entry's factory renders
        return type(factory)([dataclasses.replace(e, factory=render_factory(e.factory)) for e in entries])
    if dataclasses.is_dataclass(factory) and any(f.name == "kwargs" for f in dataclasses.fields(factory)):
        return dataclasses.replace(factory, kwargs={**dict(factory.kwargs), "render_mode": "rgb_array"})
    name = type(factory).__qualname__
    raise VideoError(f"cannot record videos of {name} envs: the factory must be a dataclass with a `kwargs` field "
                     "passed to gym.make (render_mode='rgb_array' is added there)")


def frame_of(env: Any) -> np.ndarray:
    """The env's current RGB frame (``uint8[H, W, 3]``); a :class:`VideoError` if it renders none."""
    frame = env.render()
    if isinstance(frame, list):  # some envs return the frames since the last call
        frame = frame[-1] if frame else None
    if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[-1] not in (3, 4):
        spec = getattr(env, "spec", None)
        what = getattr(spec, "id", None) or type(env).__name__
        shape = getattr(frame, "shape", None)
        raise VideoError(f"{what} does not render rgb_array frames (render() gave "
                         f"{type(frame).__name__}{'' if shape is None else f' of shape {tuple(shape)}'})")
    return np.ascontiguousarray(frame[..., :3], dtype=np.uint8)


def env_fps(env: Any, default: int) -> int:
    """Frames per second the env declares for rendering (``metadata['render_fps']``), else ``default``."""
    fps = getattr(env, "metadata", {}).get("render_fps")
    try:
        return max(1, int(round(float(fps))))
    except (TypeError, ValueError):
        return int(default)


def _even(frame: np.ndarray) -> np.ndarray:
    """H.264 in yuv420p needs even sides: pad one black row/column where a side is odd."""
    h, w = frame.shape[:2]
    if h % 2 == 0 and w % 2 == 0:
        return frame
    return np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)))


def write_mp4(path: Path, frames: Sequence[np.ndarray], fps: int) -> Path:
    """Encode ``frames`` (``uint8[H, W, 3]``, one size) as H.264 mp4 at ``path``, atomically.

    Written to a temporary name beside ``path`` and renamed: a reader (the
    report, wandb) never sees half a file, and a failed encode leaves none.
    """
    try:
        import imageio.v2 as imageio
    except ImportError as err:
        raise VideoError("videos need imageio and imageio-ffmpeg (pip install -e '.[video]')") from err
    if not frames:
        raise VideoError("no frames to encode")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.mp4")
    try:
        writer = imageio.get_writer(tmp, format="FFMPEG", mode="I", fps=int(fps), codec="libx264",
                                    pixelformat="yuv420p", macro_block_size=1, quality=7,
                                    ffmpeg_log_level="error", ffmpeg_params=["-movflags", "+faststart"])
        try:
            for frame in frames:
                writer.append_data(_even(frame))
        finally:
            writer.close()
        os.replace(tmp, path)
    except VideoError:
        raise
    except Exception as err:  # noqa: BLE001 - the encoder's failure, said in one line
        raise VideoError(f"could not encode {path.name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_mp4(path: Path) -> list[np.ndarray]:
    """Every frame of a video file (tests, the TensorBoard sink's GIF)."""
    import imageio.v2 as imageio

    reader = imageio.get_reader(Path(path), format="FFMPEG")
    try:
        return [np.asarray(frame) for frame in reader]
    finally:
        reader.close()


def gif_bytes(frames: Sequence[np.ndarray], fps: int, max_side: int = 320, max_frames: int = 300) -> bytes:
    """An animated GIF of ``frames``, scaled down to ``max_side`` pixels and ``max_frames`` frames.

    Why smaller: a GIF is stored whole in TensorBoard's event file; a
    600x400 CartPole episode of 500 frames would be tens of MB there.
    """
    import imageio.v3 as iio

    step = max(1, -(-len(frames) // max_frames))
    chosen = list(frames[::step])
    h, w = chosen[0].shape[:2]
    stride = max(1, -(-max(h, w) // max_side))
    small = np.stack([f[::stride, ::stride] for f in chosen])
    buf = io.BytesIO()
    iio.imwrite(buf, small, extension=".gif", duration=int(1000 * step / max(fps, 1)), loop=0)
    return buf.getvalue()


class FrameRecorder:
    """Collects the frames of the first ``envs`` evaluation envs, each up to ``max_steps`` frames.

    The episodes are joined in env order into one video: env 0's episode,
    then env 1's, and so on.
    """

    def __init__(self, envs: int, max_steps: int) -> None:
        self.frames: list[list[np.ndarray]] = [[] for _ in range(envs)]
        self.max_steps = int(max_steps)

    def capture(self, index: int, env: Any) -> None:
        if index < len(self.frames) and len(self.frames[index]) < self.max_steps:
            self.frames[index].append(frame_of(env))

    def joined(self) -> list[np.ndarray]:
        """All frames, one size (the first episode's: another size is padded or cropped to it)."""
        out = [f for episode in self.frames for f in episode]
        if not out:
            return out
        h, w = out[0].shape[:2]
        return [f if f.shape[:2] == (h, w) else np.pad(f, ((0, max(0, h - f.shape[0])), (0, max(0, w - f.shape[1])),
                                                            (0, 0)))[:h, :w] for f in out]

