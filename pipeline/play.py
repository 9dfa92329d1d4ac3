"""``python -m pipeline.play <run dir | checkpoint.pt> [episodes=N] [video=out.mp4] [mode=...] [env overrides]``.

Watch what a run learned: its weights play whole episodes on fresh envs of
the run's kind, with the run's observation normalisation frozen (it lives in
the model's buffers and is never updated here), each episode's return and
length printed, and their mean. By default the episodes are the run's final
evaluation replayed: the same env seeds (the ``eval/seed_index`` its summary
row holds), the same number of episodes, the same interaction mode, so the
returns are the ones the run logged. ``video=out.mp4`` records every episode
one after the other (the env's RGB frames: the emulator's screen for Atari,
not the 84x84 grey stack the policy sees).

A run directory may come from anyone, so this takes data from it, never
code: the checkpoint is read with ``weights_only=True`` (as a resume reads
it), and every ``_target_`` of the config stored inside it, and the model's
class, must be one of this project's own (``components.*``/``pipeline.*``
paths the config tree names); a gymnasium ``module:Env`` id is refused.
Overrides on the command line are the user's and are accepted: restating
a refused item (``env.factory._target_=my_pkg.MyEnvFactory``,
``model._target_=my_pkg.MyNet``) accepts it, as ``resume=`` does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: what a key=value argument may set besides env.* overrides
OPTIONS = ("episodes", "video", "mode", "seed_index", "max_steps")


class PlayError(RuntimeError):
    """What cannot be played; the message is the one line the user sees."""


def _parse(argv: list[str]) -> tuple[Path, dict[str, str], list[str]]:
    """The target, the options and the env overrides; a restated ``model._target_`` is kept among the options."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\noptions: episodes=N (default: the run's eval.episodes), video=path.mp4, "
              "mode=deterministic|mode|mean|random (default: the run's eval.mode), seed_index=K (default: the run's "
              "final evaluation), max_steps=N (per episode, default 100000); env.<key>=<value> overrides the env")
        raise SystemExit(0 if argv else 2)
    target, options, env = Path(argv[0]), {}, []
    for item in argv[1:]:
        key, sep, value = item.partition("=")
        if not sep:
            raise PlayError(f"{item!r}: expected key=value (options: {', '.join(OPTIONS)}, or env.<key>=<value>)")
        if key in OPTIONS or key == "model._target_":
            options[key] = value
        elif key.startswith("env."):
            env.append(item)
        else:
            raise PlayError(f"{key}: not an option of pipeline.play (options: {', '.join(OPTIONS)}, "
                            "or env.<key>=<value> to change the env)")
    return target, options, env


def _vet(config: dict[str, Any], model_target: str, model_kwargs: Any, restated: set[str], where: Path) -> None:
    """Refuse a stored config or model that would import or call code this project does not name, unless
    the user restated it on the command line (``restated``: its ``key=value`` items)."""
    from pipeline.plan.rules import RECURRENT_MODEL
    from pipeline.runner.saved_overrides import project_configs

    allowed = {*project_configs().targets, RECURRENT_MODEL}
    found: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            target = node.get("_target_")
            if target is not None and target not in allowed:
                found.append(f"{where}._target_={target}")
            for key, value in node.items():
                if key in ("_partial_", "_args_") and where.startswith("env"):
                    found.append(f"{where}.{key}")
                walk(value, f"{where}.{key}" if where else str(key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    walk(config.get("env", {}), "env")
    env_id = str(config.get("env", {}).get("id", ""))
    if ":" in env_id:
        found.append(f"env.id={env_id}")  # a module:Env id imports that module
    if model_target not in allowed and not model_target.startswith("components.models."):
        found.append(f"model._target_={model_target}")
    walk(model_kwargs, "model")
    found = [item for item in found if item not in restated]
    if found:
        raise PlayError(f"refused what would run code that is not this project's: {'; '.join(found)}; restate them "
                        f"on the command line to accept them: python -m pipeline.play {where} {' '.join(found)}")


def _load(target: Path) -> tuple[Path, dict[str, Any]]:
    from pipeline.runner.state import CheckpointError, read_run_state

    if not target.exists():
        raise PlayError(f"{target}: no such run directory or checkpoint")
    checkpoint = target / "checkpoint.pt" if target.is_dir() else target
    try:
        state = read_run_state(checkpoint)
    except CheckpointError as err:
        raise PlayError(f"{target}: {err}") from None
    for key in ("model", "model_spec", "config"):
        if key not in state:
            raise PlayError(f"{target}: the checkpoint has no {key!r} (written by another version of rlpipeline?)")
    return checkpoint.parent, state


def _final_eval(run_dir: Path) -> dict[str, Any]:
    """The run's summary row (its final evaluation's keys), or nothing when there is none to read."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return {}
    try:
        last = metrics.read_text(encoding="utf-8").strip().splitlines()[-1]
        return dict(json.loads(last).get("summary", {}))
    except (OSError, ValueError, IndexError, AttributeError):
        return {}


def play(argv: list[str]) -> int:
    import numpy as np
    import torch
    from omegaconf import OmegaConf

    from components.interaction import InteractionMode
    from components.models import ModelSpec
    from components.obs_tree import pack
    from components.video import VideoError, env_fps, render_factory, write_mp4, FrameRecorder
    from pipeline.plan.eval_settings import DEFAULT_FPS
    from pipeline.plan.inputs import build_env
    from pipeline.plan.validate import ConfigError
    from pipeline.runner.evaluation import EVAL_SEED_OFFSET
    from pipeline.runner.play_loop import play_episodes

    target, options, env_overrides = _parse(argv)
    run_dir, state = _load(target)
    config = state["config"]
    spec = state["model_spec"]
    restated = set(env_overrides) | ({f"model._target_={options['model._target_']}"} if "model._target_" in options
                                     else set())
    _vet(config, str(spec.get("target")), spec.get("kwargs", {}), restated, target)
    cfg = OmegaConf.create(config)
    if env_overrides:
        old_id = OmegaConf.select(cfg, "env.id", default=None)
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(env_overrides))
        # the stored config is resolved: the factory's id was ${env.id}, so a new env.id goes there too
        if OmegaConf.select(cfg, "env.factory.id", default=None) == old_id != cfg.env.get("id"):
            cfg.env.factory.id = cfg.env.id
    summary = _final_eval(run_dir)
    ev = config.get("eval") or {}
    trainer = config.get("trainer") or {}
    try:
        episodes = int(options.get("episodes") or summary.get("eval/episodes") or ev.get("episodes")
                       or trainer.get("eval_episodes") or 10)
        mode = InteractionMode.parse(options.get("mode") or ev.get("mode") or "deterministic")
        seed_index = int(options.get("seed_index") or summary.get("eval/seed_index") or 0)
        max_steps = int(options.get("max_steps") or 100_000)
    except ValueError as err:
        raise PlayError(str(err).splitlines()[0]) from None
    if episodes < 1 or max_steps < 1:
        raise PlayError("episodes and max_steps must be >= 1")
    try:
        factory, env_spec = build_env(cfg)
    except ConfigError as err:
        raise PlayError(str(err)) from None
    video = options.get("video")
    try:
        model = ModelSpec(str(spec["target"]), dict(spec.get("kwargs") or {})).build(env_spec)
        model.load_state_dict(state["model"])
    except (RuntimeError, TypeError, ValueError, KeyError) as err:
        raise PlayError(f"{target}: its weights do not fit the model it names (another version of rlpipeline, "
                        f"or a different env?): {str(err).splitlines()[0]}") from None
    model.eval()
    cycle = getattr(factory, "cycle", None)
    makers = list(cycle(episodes) if cycle is not None else [factory] * episodes)
    recorder = None
    if video:
        if not video.endswith(".mp4"):
            raise PlayError(f"video={video}: give a path ending in .mp4")
        try:
            makers = [render_factory(m) for m in makers]
        except VideoError as err:
            raise PlayError(f"video={video}: {err}") from None
        recorder = FrameRecorder(episodes, max_steps + 1)
    envs = [make() for make in makers]
    try:
        leaves = env_spec.obs_leaves

        def row(obs: Any) -> np.ndarray:
            return pack(leaves, obs) if leaves else np.asarray(obs)

        seeds = np.random.SeedSequence([int(config.get("seed", 0)), EVAL_SEED_OFFSET, seed_index]
                                       ).generate_state(episodes)
        torch.set_num_threads(1)
        try:
            returns, lengths = play_episodes(model, envs, [int(s) for s in seeds], mode, row, max_steps, recorder,
                                             every_episode=True, obs_leaves=leaves)
        except VideoError as err:
            raise PlayError(f"video={video}: {err}") from None
        for i, (ret, length) in enumerate(zip(returns, lengths)):
            cut = f" (cut at max_steps={max_steps})" if length >= max_steps else ""
            print(f"episode {i}: return {ret:.2f}, length {length}{cut}")
        print(f"mean return {float(np.mean(returns)):.2f} over {len(returns)} episode(s) "
              f"({mode.name.lower()}, seed_index {seed_index}), mean length {float(np.mean(lengths)):.1f}")
        if recorder is not None:
            fps = env_fps(envs[0], DEFAULT_FPS)
            try:
                path = write_mp4(Path(video), recorder.joined(), fps)
            except VideoError as err:
                raise PlayError(f"video={video}: {err}") from None
            print(f"video: {path} ({sum(len(f) for f in recorder.frames)} frames at {fps} fps)")
    finally:
        for env in envs:
            env.close()
    return 0


def main() -> None:
    import os

    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    try:
        code = play(sys.argv[1:])
    except PlayError as err:
        print(f"play error: {err}", file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        code = 130
    raise SystemExit(code)


if __name__ == "__main__":
    main()
