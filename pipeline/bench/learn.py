"""``python -m pipeline.bench.learn``: what the pipeline learns, against a CleanRL-style reference.

For each case of the suite (env, algorithm preset, frame budget, target) and
each seed it runs ``python -m pipeline`` and the in-repo single-file
reference (:mod:`pipeline.bench.reference_ppo`, ``reference_rppo``, ``reference_sac``) with the *same*
hyper-parameters (read from the composed config), one after the other, and
prints a table of medians over seeds: final and best mean training return,
the greedy evaluation return of the final policy, frames and wall time to
reach the target, total wall time. Every run leaves a run directory under
``--out``, so ``python -m pipeline.report <out>`` draws the curves.

    python -m pipeline.bench.learn                                # the whole suite, 3 seeds (hours on 2 CPUs)
    python -m pipeline.bench.learn --cases pendulum --seeds 1 --frames 200000 --no-reference
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    overrides: list[str]
    frames: int
    target: float | None
    env_id: str
    notes: str = ""
    extra: list[str] = field(default_factory=list)
    #: whether a reference runs the same settings (none hides velocities without a recurrent core)
    has_reference: bool = True


SUITE: dict[str, Case] = {
    "cartpole": Case([], 100_000, 475.0, "CartPole-v1", "the default config"),
    "acrobot": Case(["env=gym", "env.id=Acrobot-v1"], 100_000, -100.0, "Acrobot-v1", "the default config"),
    "pendulum": Case(["env=classic"], 1_000_000, -300.0, "Pendulum-v1", "specialize/ppo_classic.yaml"),
    "lunarlander": Case(["env=box2d"], 1_000_000, 200.0, "LunarLander-v3", "specialize/ppo_box2d.yaml"),
    "halfcheetah": Case(["env=mujoco"], 1_000_000, None, "HalfCheetah-v5", "specialize/ppo_mujoco.yaml"),
    # CartPole with its velocities hidden: an LSTM (specialize/ppo_no_velocity.yaml) against the recurrent
    # reference, and the same settings without the recurrent core (it sees a still picture: far below)
    "cartpole_novel": Case(["env=no_velocity"], 150_000, 475.0, "CartPole-v1", "specialize/ppo_no_velocity.yaml"),
    "cartpole_novel_ff": Case(["env=no_velocity", "model.rnn=null"], 150_000, 475.0, "CartPole-v1",
                              "specialize/ppo_no_velocity.yaml with model.rnn=null", has_reference=False),
    # SAC against the sequential CleanRL-style reference (pipeline/bench/reference_sac.py), same updates per frame
    "pendulum_sac": Case(["env=classic", "trainer=sac"], 20_000, -200.0, "Pendulum-v1", "specialize/sac_classic.yaml"),
    "halfcheetah_sac": Case(["env=mujoco", "trainer=sac"], 100_000, None, "HalfCheetah-v5",
                            "specialize/sac_mujoco.yaml"),
}


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from pipeline.plan.schema import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def reference_args(cfg: Any) -> list[str]:
    """The reference's command-line flags for the hyper-parameters of ``cfg`` (a composed pipeline config)."""
    t, m = cfg.trainer, cfg.model
    if str(t.name) == "sac":
        return sac_args(cfg)
    return ["--num-envs", str(cfg.env.num_envs), "--frames-per-batch", str(t.frames_per_batch), "--lr", str(t.lr),
            "--anneal-lr", str(int(t.anneal_lr)), "--gamma", str(t.gamma), "--gae-lambda", str(t.gae_lambda),
            "--minibatches", str(t.minibatches), "--epochs", str(t.epochs), "--clip-coef", str(t.clip_coef),
            "--clip-vloss", str(int(t.clip_vloss)), "--ent-coef", str(t.ent_coef), "--vf-coef", str(t.vf_coef),
            "--max-grad-norm", str(t.max_grad_norm),
            *(() if m.get("rnn") is not None else  # the recurrent reference takes the two apart (recurrent_args)
              ("--normalize", str(int(bool(m.get("obs_norm", False)) or bool(t.get("reward_scale", False)))))),
            "--hidden", str(int(m.hidden[0]))] + recurrent_args(cfg)


def sac_args(cfg: Any) -> list[str]:
    """The SAC reference's flags: the same envs, networks, rates, ratio and warm-up (its critics: hidden[0] wide)."""
    t = cfg.trainer
    return ["--num-envs", str(cfg.env.num_envs), "--buffer-size", str(cfg.replay.capacity), "--gamma", str(t.gamma),
            "--tau", str(t.tau), "--batch-size", str(t.batch_size), "--learning-starts", str(t.learning_starts),
            "--policy-lr", str(t.actor_lr), "--q-lr", str(t.critic_lr), "--alpha-lr", str(t.alpha_lr),
            "--policy-frequency", str(t.policy_frequency), "--target-network-frequency", str(t.target_update_period),
            "--alpha", str(t.alpha), "--autotune", str(int(t.autotune)), "--updates-per-frame", str(t.updates_per_frame),
            "--hidden", str(int(cfg.model.hidden[0])), "--threads", str(int(cfg.torch_threads))]


def recurrent_args(cfg: Any) -> list[str]:
    """The recurrent reference's extra flags (none for a feed-forward model)."""
    m = cfg.model
    if m.get("rnn") is None:
        return []
    return ["--rnn", str(m.rnn), "--rnn-hidden", str(int(m.rnn_hidden)), "--rnn-layers", str(int(m.rnn_layers)),
            "--no-velocity", str(int(str(cfg.env.name) == "no_velocity")), "--activation", str(m.activation),
            "--normalize", str(int(bool(m.get("obs_norm", False)))),
            "--reward-scale", str(int(bool(cfg.trainer.get("reward_scale", False)))),
            # the pipeline's MLP-encoder recurrent model gives the critic its own trunk (components.recurrent)
            "--critic-trunk", str(int(str(m.encoder) == "mlp"))]


def reference_module(cfg: Any) -> str:
    """The CleanRL-style reference of the same algorithm and model kind: SAC, recurrent PPO, or plain PPO."""
    if str(cfg.trainer.name) == "sac":
        return "pipeline.bench.reference_sac"
    return "pipeline.bench.reference_rppo" if cfg.model.get("rnn") is not None else "pipeline.bench.reference_ppo"


def read_run(run_dir: Path, target: float | None) -> dict[str, float | None]:
    rows, summary = [], {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "summary" in row:
            summary = row["summary"]
        else:
            rows.append(row)
    updates = [r["train/updates"] for r in rows if isinstance(r.get("train/updates"), (int, float))]
    curve = [(r["frames"], r.get("time"), r["episode/return_mean"]) for r in rows
             if isinstance(r.get("episode/return_mean"), (int, float))]
    reached = next(((f, t) for f, t, ret in curve if target is not None and ret >= target), (None, None))
    return {"final": summary.get("episode/return_mean"), "best": max((c[2] for c in curve), default=None),
            "eval": summary.get("eval/return_mean"), "frames_to_target": reached[0], "time_to_target": reached[1],
            "wall": summary.get("wall_time_s"), "updates": summary.get("train/updates", updates[-1] if updates else None)}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def run_case(name: str, case: Case, seed: int, frames: int, out: Path, reference: bool, env: dict[str, str],
             extra: list[str] | None = None) -> dict:
    results = {}
    overrides = [*case.overrides, *(extra or [])]
    eval_every = max(1, frames // 10)
    ours_dir = out / name / f"ours-seed{seed}"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pipeline", *overrides, f"seed={seed}",
                           f"trainer.total_frames={frames}", "trainer.target_return=null",
                           f"eval.interval={eval_every}", "logger=jsonl", "progress=false",
                           f"hydra.run.dir={ours_dir}"], cwd=out, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} (pipeline) exited {done.returncode}: {done.stderr.strip()[-500:]}")
    given = (ours_dir / ".hydra" / "overrides.yaml").read_text()
    (ours_dir / ".hydra" / "overrides.yaml").write_text(given + "- impl=pipeline\n")  # the report colours by it
    results["ours"] = read_run(ours_dir, case.target)
    print(f"  {name} seed {seed} pipeline: {time.monotonic() - started:.0f} s, final "
          f"{_fmt(results['ours']['final'])}, eval {_fmt(results['ours']['eval'])}", flush=True)
    if reference and case.has_reference:
        ref_dir = out / name / f"reference-seed{seed}"
        started = time.monotonic()
        cfg = _compose(overrides)
        done = subprocess.run([sys.executable, "-m", reference_module(cfg), "--env-id", case.env_id,
                               "--seed", str(seed), "--total-frames", str(frames),
                               *reference_args(cfg), "--out", str(ref_dir)],
                              cwd=out, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{name} seed {seed} (reference) exited {done.returncode}: {done.stderr.strip()[-500:]}")
        (ref_dir / ".hydra").mkdir(exist_ok=True)
        (ref_dir / ".hydra" / "overrides.yaml").write_text(given.replace("- impl=pipeline\n", "") + "- impl=reference\n")
        results["reference"] = read_run(ref_dir, case.target)
        print(f"  {name} seed {seed} reference: {time.monotonic() - started:.0f} s, final "
              f"{_fmt(results['reference']['final'])}, eval {_fmt(results['reference']['eval'])}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench.learn", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(SUITE), help=f"of {', '.join(SUITE)}")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--seed-list", type=int, nargs="+", default=None, metavar="SEED",
                        help="these seeds instead (e.g. to add seeds to an earlier run)")
    parser.add_argument("--frames", type=int, default=None, help="override every case's budget (quick runs)")
    parser.add_argument("--no-reference", action="store_true", help="only the pipeline")
    parser.add_argument("--out", type=Path, default=None, help="default: runs/bench-learn/<time>")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every case, given to both implementations (repeatable), "
                             "e.g. --set trainer.anneal_lr=true")
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases if c not in SUITE]
    if unknown:
        print(f"error: unknown case(s) {unknown}; choose from {list(SUITE)}", file=sys.stderr)
        return 2
    out = (args.out or Path("runs") / "bench-learn" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    seeds = list(args.seed_list) if args.seed_list else list(range(args.seeds))
    table = []
    for name in args.cases:
        case = SUITE[name]
        frames = args.frames or case.frames
        print(f"{name}: {case.env_id}, {frames:,} frames, {len(seeds)} seed(s) ({case.notes})", flush=True)
        per_seed = [run_case(name, case, seed, frames, out, not args.no_reference, env, args.extra) for seed in seeds]
        for impl in ("ours", "reference"):
            runs = [r[impl] for r in per_seed if impl in r]
            if not runs:
                continue
            reached = sum(r["frames_to_target"] is not None for r in runs)
            table.append((name, "pipeline" if impl == "ours" else "reference", frames,
                          _median([r["final"] for r in runs]), _median([r["best"] for r in runs]),
                          _median([r["eval"] for r in runs]), case.target, reached, len(runs),
                          _median([r["frames_to_target"] for r in runs]), _median([r["time_to_target"] for r in runs]),
                          _median([r["wall"] for r in runs]), _median([r.get("updates") for r in runs])))
    print(f"\nmedians over seeds {', '.join(map(str, seeds))}; runs in {out} (python -m pipeline.report {out})")
    print("| case | implementation | frames | final return | best return | greedy eval | target | reached "
          "| frames to target | s to target | wall s | gradient steps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, impl, frames, final, best, ev, target, reached, n, ftt, ttt, wall, steps in table:
        print(f"| {name} | {impl} | {frames:,} | {_fmt(final)} | {_fmt(best)} | {_fmt(ev)} | {_fmt(target, 0)} "
              f"| {reached}/{n} | {_fmt(ftt, 0)} | {_fmt(ttt)} | {_fmt(wall)} | {_fmt(steps, 0)} |")
    with open(out / "learn.jsonl", "w", encoding="utf-8") as fh:
        for row in table:
            fh.write(json.dumps(dict(zip(("case", "implementation", "frames", "final", "best", "eval", "target",
                                          "reached", "seeds", "frames_to_target", "time_to_target", "wall",
                                          "updates"), row)))
                     + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
