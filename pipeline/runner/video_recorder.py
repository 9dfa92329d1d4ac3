"""Evaluation videos made in a process of their own, at the lowest CPU priority.

Measured on CartPole (2 CPUs, an evaluation every 10k of 100k frames):
rendering in the evaluation thread (pygame, 1.6 ms a 600x400 frame, holding
the GIL) and encoding beside it (x264, 1.35 s of CPU for 500 frames) took
collection from 18.7k to 8.6k frames/s. Both are CPU the collector and the
trainer need, and the rendering was GIL time of the driver. So the videos
are made here instead: a spawned child at ``nice 19`` (it gets a core only
when the run leaves one idle), with one thread per pool, that replays the
episodes the evaluation envs play (the same env seeds and weights, in the
evaluation's interaction mode) on rendering envs and encodes them.

A video is never waited for during training: while one is being made, a
later one is skipped (counted); the final one is waited for, within a
bound, when the run ends. A recorder that fails or dies is one warning and
the run goes on without videos.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

#: seconds the end of a run waits for its final video
FINAL_VIDEO_TIMEOUT_S = 300.0


def _recorder_main(conn: Any, env_factory: Any, model_spec: Any, env_spec: Any, settings: Any, mode: int,
                   videos_dir: str, parent_pid: int) -> None:
    from components.lifecycle import become_child
    from components.threads import pin_pools

    become_child(parent_pid, True)
    os.nice(19)  # only the CPU the run leaves idle
    pin_pools(1)
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    import numpy as np
    import torch

    from components.interaction import InteractionMode
    from components.obs_tree import pack
    from components.video import FrameRecorder, env_fps, render_factory, write_mp4
    from pipeline.plan.eval_settings import DEFAULT_FPS
    from pipeline.runner.play_loop import play_episodes

    envs: list[Any] = []
    try:
        model = model_spec.build(env_spec).eval()
        cycle = getattr(env_factory, "cycle", None)
        makers = cycle(settings.episodes) if cycle is not None else [env_factory] * settings.episodes
        envs = [render_factory(make)() for make in makers]
        leaves = env_spec.obs_leaves
        fps = settings.fps or env_fps(envs[0], DEFAULT_FPS)
        conn.send(("ready",))
        while True:
            message = conn.recv()
            if message is None:
                break
            _, weights, seeds, frames = message
            try:
                model.load_state_dict(weights)
                recorder = FrameRecorder(settings.episodes, settings.max_steps)
                with torch.no_grad():
                    play_episodes(model, envs, seeds, InteractionMode(mode),
                                  (lambda o: pack(leaves, o)) if leaves else np.asarray,
                                  settings.max_steps, recorder, every_episode=True, obs_leaves=leaves)
                path = write_mp4(Path(videos_dir) / f"{int(frames)}.mp4", recorder.joined(), fps)
                conn.send(("done", str(path), int(frames)))
            except Exception as err:  # noqa: BLE001 - one line for the driver
                text = str(err).strip().splitlines()
                conn.send(("error", f"{type(err).__name__}: {text[0] if text else ''}"))
                break
    except (EOFError, OSError):
        pass  # the driver is gone
    except Exception as err:  # noqa: BLE001 - the recorder could not start
        text = str(err).strip().splitlines()
        try:
            conn.send(("error", f"{type(err).__name__}: {text[0] if text else ''}"))
        except OSError:
            pass
    finally:
        for env in envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001
                pass


class VideoRecorder:
    """The driver's end: ``submit`` a video (never blocking), ``poll`` finished ones, ``close``.

    Built on the driver's main thread, which also starts the child (lazily, at the first video):
    a child started from a short-lived evaluation thread would be killed by its parent-death signal
    when that thread ends.
    """

    def __init__(self, env_factory: Any, model_spec: Any, env_spec: Any, settings: Any, mode: int,
                 videos_dir: Path) -> None:
        self.settings = settings
        self._args = (env_factory, model_spec, env_spec, settings, int(mode), str(videos_dir))
        self._process: Any = None
        self._conn: Any = None
        self.busy = False
        self.disabled: str | None = None
        self.skipped = 0
        self._done: list[tuple[Path, int]] = []

    def _start(self) -> None:
        from components.lifecycle import start_immune
        from components.threads import child_pools

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_recorder_main, args=(child, *self._args, os.getpid()),
                                    name="eval-videos", daemon=True)
        with child_pools(1):
            start_immune(self._process)
        child.close()

    def submit(self, weights: dict[str, Any], seeds: list[int], frames: int, wait: float = 0.0) -> bool:
        """Ask for a video of these weights on these seeds; False (skipped) while one is being made.

        ``wait``: seconds to wait for the one being made first (the final video).
        """
        self._read()
        if self.disabled is not None:
            return False
        deadline = time.monotonic() + wait
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.05)
            self._read()
        if self.busy or self.disabled is not None:
            self.skipped += 1
            return False
        if self._process is None:
            self._start()
        try:
            self._conn.send(("record", weights, [int(s) for s in seeds], int(frames)))
        except (OSError, ValueError) as err:
            self._disable(f"the video process is gone ({type(err).__name__})")
            return False
        self.busy = True
        return True

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            print(f"warning: evaluation videos stop: {why}; the run goes on without them", file=sys.stderr,
                  flush=True)
        self.busy = False

    def poll(self) -> list[tuple[Path, int]]:
        """Videos finished since the last call: ``(path, frames)``."""
        self._read()
        done, self._done = self._done, []
        return done

    def _read(self) -> None:
        """Take the child's messages: finished videos are kept for :meth:`poll`."""
        while self._conn is not None and self.disabled is None:
            try:
                if not self._conn.poll():
                    break
                message = self._conn.recv()
            except (EOFError, OSError):
                self._disable("the video process died")
                break
            if message[0] == "done":
                self._done.append((Path(message[1]), int(message[2])))
                self.busy = False
            elif message[0] == "error":
                self._disable(f"the video process failed: {message[1]}")
        if self.busy and self._process is not None and not self._process.is_alive() and self.disabled is None:
            self._read_after_death()

    def _read_after_death(self) -> None:
        try:
            while self._conn.poll():
                message = self._conn.recv()
                if message[0] == "done":
                    self._done.append((Path(message[1]), int(message[2])))
                    self.busy = False
        except (EOFError, OSError):
            pass
        if self.busy:
            self._disable(f"the video process died (exit code {self._process.exitcode})")

    def wait(self, timeout: float) -> None:
        """Until the video being made is written (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self.busy and self.disabled is None and time.monotonic() < deadline:
            time.sleep(0.05)
            self._read()

    def close(self) -> None:
        if self._process is None:
            return
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()
        self._process = None
