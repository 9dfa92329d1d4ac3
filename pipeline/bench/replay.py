"""``python -m pipeline.bench.replay``: replay throughput, this project's buffer against TorchRL's.

Every contender gets the same pre-built batches: CartPole-shaped transitions
(float32[4] observations) and Atari-shaped ones (uint8 4x84x84 stacks built
the way a frame-stacking wrapper builds them, episodes of random length, 16
envs interleaved), which this project stores with its frame-deduplicating
``FrameStackStorage`` and TorchRL as plain stacked tensors. Each trial builds
a fresh buffer, extends it until it is full (timed), samples from it (timed)
and, for prioritized samplers, updates priorities (timed). Contenders
alternate within every repeat, in reverse order on odd repeats, so drifts of
a shared machine hit all of them alike; the table shows medians and the ratio
ours / TorchRL per row.

Examples::

    python -m pipeline.bench.replay                                  # everything, a few minutes
    python -m pipeline.bench.replay --workloads atari --repeats 5
    python -m pipeline.bench.replay --capacity 20000 --atari-capacity 2000 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from components.replay.buffer import ReplayBuffer
from components.replay.frames import FrameStackStorage, default_frame_capacity
from components.replay.storage import TensorStorage

METRICS = ("extend", "sample", "update")


# -- workloads ------------------------------------------------------------------------------------
def _transitions(obs: np.ndarray, nxt: np.ndarray, env: np.ndarray, step: np.ndarray, done: np.ndarray,
                 rng: np.random.Generator) -> TensorDict:
    n = env.size
    return TensorDict({
        "observation": torch.from_numpy(obs),
        "action": torch.from_numpy(rng.integers(0, 6, n)),
        "policy_version": torch.from_numpy(step // 64),
        "env_index": torch.from_numpy(env),
        "env_step": torch.from_numpy(step),
        "next": {"observation": torch.from_numpy(nxt), "reward": torch.from_numpy(rng.normal(size=n).astype(np.float32)),
                 "terminated": torch.from_numpy(done), "truncated": torch.zeros(n, dtype=torch.bool),
                 "done": torch.from_numpy(done)},
    }, [n])


def cartpole_stream(rows: int, num_envs: int, seed: int) -> TensorDict:
    rng = np.random.default_rng(seed)
    env = np.tile(np.arange(num_envs), -(-rows // num_envs))[:rows]
    step = np.arange(rows) // num_envs
    obs = rng.normal(size=(rows, 4)).astype(np.float32)
    return _transitions(obs, obs + 0.01, env, step, rng.random(rows) < 0.02, rng)


def atari_stream(rows: int, num_envs: int, seed: int, stack: int = 4, mean_episode: int = 300) -> TensorDict:
    """Frame stacks as a frame-stacking wrapper makes them (reset frame repeated), envs interleaved time-major."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (rows + 4 * num_envs + rows // 20 + 16, 84, 84), dtype=np.uint8)
    used = 0

    def new_frame() -> np.ndarray:
        nonlocal used
        used = (used + 1) % frames.shape[0]
        return frames[used]

    stacks = [[new_frame()] * stack for _ in range(num_envs)]
    obs = np.empty((rows, stack, 84, 84), np.uint8)
    nxt = np.empty_like(obs)
    env = np.tile(np.arange(num_envs), -(-rows // num_envs))[:rows]
    step = np.arange(rows) // num_envs
    done = rng.random(rows) < 1.0 / mean_episode
    for i in range(rows):
        e = env[i]
        following = stacks[e][1:] + [new_frame()]
        obs[i], nxt[i] = stacks[e], following
        stacks[e] = [new_frame()] * stack if done[i] else following
    return _transitions(obs, nxt, env, step, done, rng)


# -- contenders -----------------------------------------------------------------------------------
class Ours:
    def __init__(self, workload: str, storage: str, sampler: str, capacity: int, scratch: Path) -> None:
        path = scratch / "ours" if storage == "disk" else None
        store = FrameStackStorage(capacity, path=path) if workload == "atari" else TensorStorage(capacity, path=path)
        self.rb = ReplayBuffer(store, sampler=sampler, seed=0)
        self.capacity = capacity
        self.written = 0

    def extend(self, batch: TensorDict) -> None:
        self.rb.extend(batch)
        self.written += batch.batch_size[0]

    def sample(self, n: int) -> TensorDict:
        return self.rb.sample(n)

    def update(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        self.rb.update_priorities(index, priority)

    def bytes_per_transition(self) -> float:
        return self.rb.storage.nbytes / self.capacity

    def extra(self) -> dict[str, float]:
        storage = self.rb.storage
        if not isinstance(storage, FrameStackStorage):
            return {}
        return {"frame_bytes_per_transition": storage.frame_bytes_per_transition,
                "frames_per_transition": storage.frames_written / max(1, self.written)}


class TorchRL:
    def __init__(self, workload: str, storage: str, sampler: str, capacity: int, scratch: Path) -> None:
        from torchrl.data import (LazyMemmapStorage, LazyTensorStorage, PrioritizedSampler, RandomSampler,
                                  TensorDictReplayBuffer)

        store = LazyMemmapStorage(capacity, scratch_dir=scratch / "torchrl") if storage == "disk" \
            else LazyTensorStorage(capacity)
        picker = PrioritizedSampler(capacity, alpha=0.6, beta=0.4) if sampler == "prioritized" else RandomSampler()
        self.rb = TensorDictReplayBuffer(storage=store, sampler=picker)
        self.capacity = capacity

    def extend(self, batch: TensorDict) -> None:
        self.rb.extend(batch.clone(False))  # it may add keys to what it is given

    def sample(self, n: int) -> TensorDict:
        return self.rb.sample(n)

    def update(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        self.rb.update_priority(index, priority)

    def bytes_per_transition(self) -> float:
        data = self.rb.storage._storage  # the stored TensorDict; no public accessor
        return sum(v.numel() * v.element_size() for v in data.values(True, True)) / self.capacity

    def extra(self) -> dict[str, float]:
        return {}


IMPLS = {"ours": Ours, "torchrl": TorchRL}


def torchrl_status() -> tuple[str | None, str | None]:
    """(why TorchRL cannot be used, why its C++ extension cannot be used); None where it can.

    TorchRL's ``PrioritizedSampler`` needs its compiled segment trees, which
    only load with the torch version TorchRL was built against.
    """
    try:
        import torchrl.data  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means "skip TorchRL"
        return f"{type(err).__name__}: {err}", None
    try:
        import torchrl._torchrl  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return None, f"{type(err).__name__}: {str(err)[:160]}"
    return None, None


# -- trials ---------------------------------------------------------------------------------------
def run_trial(impl: str, workload: str, storage: str, sampler: str, batches: list[TensorDict],
              args: argparse.Namespace) -> dict[str, Any]:
    """One contender on a fresh buffer; a failure is a result, never a crash of the benchmark."""
    capacity = args.atari_capacity if workload == "atari" else args.capacity
    scratch = Path(tempfile.mkdtemp(prefix="replay-bench-", dir=args.scratch))
    rb = None
    try:
        rb = IMPLS[impl](workload, storage, sampler, capacity, scratch)
        rb.extend(batches[0])  # lazy layout and allocation happen here, untimed
        n_extend = args.extend_batches or math.ceil(capacity / args.extend_batch)
        started = time.perf_counter()
        for i in range(n_extend):
            rb.extend(batches[(i + 1) % len(batches)])
        extend_s = time.perf_counter() - started
        out = rb.sample(args.sample_batch)
        started = time.perf_counter()
        for _ in range(args.sample_batches):
            out = rb.sample(args.sample_batch)
        sample_s = time.perf_counter() - started
        result = {"ok": True, "extend": n_extend * args.extend_batch / extend_s,
                  "sample": args.sample_batches * args.sample_batch / sample_s,
                  "bytes_per_transition": rb.bytes_per_transition(), **rb.extra()}
        if sampler == "prioritized":
            priorities = torch.rand(args.sample_batches, args.sample_batch)
            started = time.perf_counter()
            for row in priorities:
                rb.update(out["index"], row)
            result["update"] = args.sample_batches * args.sample_batch / (time.perf_counter() - started)
        return result
    except Exception as err:  # noqa: BLE001
        return {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
    finally:
        del rb
        gc.collect()
        shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    notes: list[str] = []
    impls = list(args.impls)
    why_ext = None
    if "torchrl" in impls:
        why, why_ext = torchrl_status()
        if why is not None:
            impls.remove("torchrl")
            notes.append(f"torchrl is not importable ({why}); its rows are skipped (pip install 'rlpipeline[bench]')")
        elif why_ext is not None and "prioritized" in args.samplers:
            notes.append(f"torchrl's C++ extension does not load with torch {torch.__version__} ({why_ext}), "
                         "so its PrioritizedSampler cannot run: those rows are empty")
    data: dict[str, list[TensorDict]] = {}
    for workload in args.workloads:
        capacity = args.atari_capacity if workload == "atari" else args.capacity
        pool = min(math.ceil(capacity / args.extend_batch) + 1, args.max_data_batches)
        make = atari_stream if workload == "atari" else cartpole_stream
        stream = make(pool * args.extend_batch, args.num_envs, seed=0)
        data[workload] = list(stream.split(args.extend_batch))
    rows = [(w, s, p) for w in args.workloads for s in args.storages for p in args.samplers]
    plan = [(impl, *row) for row in rows for impl in impls]
    trials = []
    for repeat in range(args.repeats):
        for impl, workload, storage, sampler in plan if repeat % 2 == 0 else reversed(plan):
            result = run_trial(impl, workload, storage, sampler, data[workload], args)
            trials.append({"impl": impl, "workload": workload, "storage": storage, "sampler": sampler,
                           "repeat": repeat, **result})
            shown = (f"extend {result['extend']:>12,.0f}/s  sample {result['sample']:>12,.0f}/s" if result["ok"]
                     else f"FAILED: {result['error']}")
            print(f"  [{repeat + 1}/{args.repeats}] {impl:8s} {workload:9s} {storage:7s} {sampler:12s} {shown}",
                  flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for impl, workload, storage, sampler in plan:
        runs = [t for t in trials if (t["impl"], t["workload"], t["storage"], t["sampler"])
                == (impl, workload, storage, sampler)]
        entry: dict[str, Any] = {"runs": len(runs), "ok": sum(t["ok"] for t in runs)}
        for metric in (*METRICS, "bytes_per_transition", "frame_bytes_per_transition", "frames_per_transition"):
            values = [t[metric] for t in runs if t["ok"] and metric in t]
            if values:
                entry[metric] = statistics.median(values)
        if not entry["ok"]:
            entry["error"] = runs[-1].get("error")
        summary[f"{impl}/{workload}/{storage}/{sampler}"] = entry
    for key, entry in summary.items():
        if "error" in entry and not (key.startswith("torchrl/") and key.endswith("/prioritized") and why_ext):
            notes.append(f"{key} failed: {entry['error']}")
    report = {"created": dt.datetime.now().isoformat(timespec="seconds"), "args": vars(args),
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "platform": platform.platform(), "cpus": os.cpu_count()},
              "notes": notes, "summary": summary, "trials": trials}
    return report


def format_report(report: dict[str, Any]) -> str:
    summary, args = report["summary"], report["args"]
    head = "| workload | storage | sampler |" + "".join(f" {m}/s ours | {m}/s torchrl | x |" for m in METRICS)
    lines = [head, "|---|---|---|" + "---:|---:|---:|" * len(METRICS)]
    for workload in args["workloads"]:
        for storage in args["storages"]:
            for sampler in args["samplers"]:
                ours = summary.get(f"ours/{workload}/{storage}/{sampler}", {})
                theirs = summary.get(f"torchrl/{workload}/{storage}/{sampler}", {})
                row = f"| {workload} | {storage} | {sampler} |"
                for metric in METRICS:
                    a, b = ours.get(metric), theirs.get(metric)
                    row += f" {a:,.0f} |" if a else " - |"
                    row += f" {b:,.0f} |" if b else " - |"
                    row += f" {a / b:.2f} |" if a and b else " - |"
                lines.append(row)
    if "atari" in args["workloads"]:
        ours = next((e for k, e in summary.items() if k.startswith("ours/atari/") and "bytes_per_transition" in e), None)
        theirs = next((e for k, e in summary.items() if k.startswith("torchrl/atari/") and "bytes_per_transition" in e),
                      None)
        naive = 2 * 4 * 84 * 84
        if ours:
            million = default_frame_capacity(1_000_000, 4) * 84 * 84
            lines += [
                "",
                f"Atari bytes/transition at capacity {args['atari_capacity']:,}: ours {ours['bytes_per_transition']:,.0f} "
                f"(frames {ours['frame_bytes_per_transition']:,.0f}; {ours['frames_per_transition']:.3f} distinct "
                f"frames written per transition written)"
                + (f"; TorchRL LazyTensorStorage {theirs['bytes_per_transition']:,.0f} "
                   f"({theirs['bytes_per_transition'] / ours['bytes_per_transition']:.1f}x ours)" if theirs else ""),
                f"Atari at 1,000,000 transitions: ours {million / 1e9:.2f} GB of frames ({million / 1e6:,.0f} B each), "
                f"naive stacked obs {naive * 1e6 / 1e9:.1f} GB ({naive:,} B each, {naive * 1e6 / million:.1f}x ours)",
            ]
    lines.extend(f"note: {note}" for note in report["notes"])
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench.replay", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["cartpole", "atari"], choices=["cartpole", "atari"])
    p.add_argument("--storages", nargs="+", default=["memory", "disk"], choices=["memory", "disk"])
    p.add_argument("--samplers", nargs="+", default=["uniform", "prioritized"], choices=["uniform", "prioritized"])
    p.add_argument("--impls", nargs="+", default=["ours", "torchrl"], choices=list(IMPLS))
    p.add_argument("--capacity", type=int, default=100_000, help="CartPole buffer capacity (transitions)")
    p.add_argument("--atari-capacity", type=int, default=10_000, help="Atari buffer capacity (transitions)")
    p.add_argument("--extend-batch", type=int, default=256, help="transitions per extend")
    p.add_argument("--sample-batch", type=int, default=256, help="transitions per sample")
    p.add_argument("--extend-batches", type=int, default=0, help="timed extends per trial (0: fill the buffer once)")
    p.add_argument("--sample-batches", type=int, default=100, help="timed samples (and priority updates) per trial")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-envs", type=int, default=16, help="envs interleaved in the synthetic streams")
    p.add_argument("--max-data-batches", type=int, default=48,
                   help="distinct pre-built batches per workload, cycled (bounds the benchmark's own memory)")
    p.add_argument("--scratch", default=None, help="directory for disk storages (default: the system temp dir)")
    p.add_argument("--out", default="runs/bench/replay", help="where the JSON report goes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    print(f"replay benchmark: {args.repeats} repeats, capacity {args.capacity:,} (CartPole) / "
          f"{args.atari_capacity:,} (Atari), batches of {args.extend_batch} in, {args.sample_batch} out", flush=True)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"replay_{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(format_report(report))
    print(f"report: {path}")
    return report


if __name__ == "__main__":
    main()
