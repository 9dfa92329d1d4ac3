"""Runs contenders side by side: alternating, repeated, medians and ratios.

Each trial runs in a fresh spawned process (so no contender inherits
another's threads, memory or warm caches) with a timeout; the harness
alternates contenders within every repeat, reversing the order on odd
repeats so slow drifts of a shared machine cancel out, and reports the
median of the repeats.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import multiprocessing as mp
import platform
import statistics
from pathlib import Path
from typing import Any

from components.threads import child_pools
from pipeline.bench.contenders import BASELINES, CPUS, TORCHRL, TRIAL_THREADS, trial_main
from pipeline.bench.settings import check_settings

OURS = [
    "ours:auto",
    "ours:train",
    "ours:thread/none/inline/auto",
    "ours:thread/slots/thread/auto",
    "ours:thread/slots/process/auto",
    "ours:process/none/inline/auto",
    "ours:process/slots/thread/auto",
    "ours:process/slots/thread/step",
    "ours:process/slots/process/auto",
    "ours:process/slots/process/step",
]
#: ``contenders: default``: what ``transport=auto`` picks, the central-server and inline layouts, the
#: baselines, and TorchRL where it starts in reasonable time (one process per env).
DEFAULT = ["ours:auto", "ours:train", "ours:process/slots/process/auto", "ours:process/none/inline/auto",
           "gym_sync", "gym_async", "bare_procs"]
DEFAULT_TORCHRL_MAX_ENVS = 16


#: ``scale=true``: ours:auto (planned for collection alone), ours:train (planned for its trainer) and the loops,
#: from 8 to 1,024 envs
SCALE_ENVS = [8, 16, 32, 64, 128, 256, 512, 1024]
SCALE_CONTENDERS = ["ours:auto", "ours:train", "gym_sync", "bare_procs"]


def apply_scale(cfg: dict[str, Any]) -> dict[str, Any]:
    """``scale=true``: the env-count sweep of ``ours:auto`` and ``ours:train`` against ``gym_sync`` and ``bare_procs``.

    Explicit ``sweep_envs`` or ``contenders`` lists win over the sweep's.
    """
    if not cfg.get("scale"):
        return cfg
    out = dict(cfg)
    out["sweep_envs"] = list(cfg.get("sweep_envs") or SCALE_ENVS)
    out["sweep_contenders"] = list(SCALE_CONTENDERS)
    if cfg.get("contenders") == "default":
        out["contenders"] = list(SCALE_CONTENDERS)
    return out


def resolve_contenders(cfg: dict[str, Any]) -> list[str]:
    """``all`` (the full matrix), ``default`` (about five minutes), or an explicit list (checked by check_settings)."""
    chosen = cfg["contenders"]
    if chosen == "all":
        return OURS + BASELINES + TORCHRL
    if chosen == "default":
        extra = ["torchrl_auto"] if int(cfg["num_envs"]) <= DEFAULT_TORCHRL_MAX_ENVS else []
        if importlib.util.find_spec("ray") is not None:
            extra.insert(0, "ours:ray")  # next to ours:process/none/inline/auto: what going through Ray costs
        return DEFAULT + extra
    return list(chosen)


def min_costs(all_costs: list[Any]) -> Any:
    """Each cost's smallest value over several probes (the least disturbed reading of each)."""
    from pipeline.plan.layout import Costs

    first = all_costs[0]
    return Costs(min(c.env_wall_s for c in all_costs), min(c.env_cpu_s for c in all_costs),
                 {b: min(c.infer_s[b] for c in all_costs) for b in first.infer_s},
                 min(c.loop_step_s for c in all_costs), min(c.loop_env_s for c in all_costs),
                 min(c.hop_s for c in all_costs), first.engine, first.cpus, first.trainer_s, first.obs_bytes,
                 first.frame_bytes, min(c.copy_s_per_byte for c in all_costs),
                 max(c.copy_share for c in all_costs))


def predicted_fps(contender: str, result: dict[str, Any], num_envs: int, costs: Any) -> float | None:
    """The layout model's frames/s for the graph one of our trials built (None for the others, and Ray)."""
    from pipeline.plan.layout import Layout, predict

    graph = result.get("graph")
    if not contender.startswith("ours:") or not graph or graph.get("workers") == "ray" or "+" in contender:
        return None  # a +lstm variant serves another model than the one the costs were probed with
    layout = Layout(graph["workers"], graph["server"], graph["envs_per_worker"], graph["splits"],
                    concurrent=bool(graph.get("concurrent_envs")))
    return predict(layout, costs, num_envs).predicted_fps


def torchrl_available() -> bool:
    return importlib.util.find_spec("torchrl") is not None


def run_trial(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One contender in a fresh process; a failure or timeout is a result, not a crash."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=trial_main, args=(spec, child), name=f"bench-{spec['contender']}")
    with child_pools(TRIAL_THREADS):  # before the trial loads numpy: see components.threads
        process.start()
    child.close()
    try:
        if parent.poll(timeout):
            result = parent.recv()
        else:
            result = {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    except EOFError:
        result = {"ok": False, "error": f"the trial process died (exit code {process.exitcode})"}
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join(5)
    return result


def _fps(result: dict[str, Any]) -> float | None:
    if not result.get("ok") or not result.get("seconds"):
        return None
    return result["frames"] / result["seconds"]


def machine() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": CPUS, "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}


def trial_plan(cfg: dict[str, Any], contenders: list[str]) -> tuple[list[tuple[str, int]], list[str]]:
    """(contender, num_envs) pairs of one repeat, and notes on what was left out.

    Every contender runs at the main env count; the sweep adds the
    ``sweep_contenders`` at the other counts. TorchRL's slot transport needs
    one process per env, each importing torch: past a few dozen envs that is
    minutes of start-up and GBs of memory, so ``torchrl_max_envs`` thins the
    sweep (never the main count).
    """
    main_envs = int(cfg["num_envs"])
    plan = [(c, main_envs) for c in contenders]
    sweep_contenders = [c for c in cfg.get("sweep_contenders", []) if c in contenders or c.startswith("ours:")]
    plan += [(c, n) for n in cfg.get("sweep_envs", []) if n != main_envs for c in sweep_contenders]
    cap = int(cfg.get("torchrl_max_envs", 64))

    def capped(contender: str, n: int) -> bool:
        return contender.startswith("torchrl_") and n > cap and n != main_envs

    notes = []
    too_many = sorted({n for c, n in plan if capped(c, n)})
    if too_many:
        notes.append(f"torchrl contenders skipped at {too_many} envs (torchrl_max_envs={cap}: one process per env)")
    return [(c, n) for c, n in plan if not capped(c, n)], notes


def run_bench(cfg: dict[str, Any], out_dir: Path, log: Any = print) -> dict[str, Any]:
    """Run the benchmark ``cfg`` describes; returns (and writes) the report."""
    import time

    from pipeline.plan.layout import Costs, machine_limit

    check_settings(cfg)
    cfg = apply_scale(cfg)
    workload = {**cfg["workload"], "device": str(cfg.get("device", "cpu"))}
    contenders = resolve_contenders(cfg)
    notes = []
    if not torchrl_available():
        skipped = [c for c in contenders if c.startswith("torchrl_")]
        contenders = [c for c in contenders if not c.startswith("torchrl_")]
        if skipped:
            notes.append("torchrl is not installed (pip install 'rlpipeline[bench]'): skipped " + ", ".join(skipped))
    main_envs = int(cfg["num_envs"])
    plan, plan_notes = trial_plan(cfg, contenders)
    notes += plan_notes
    # The costs first: the limit and every prediction come from them. Probed again at every
    # repeat, keeping each cost's smallest value: a probe that a busy moment slowed would lower the
    # limit (and flatter every "% of limit").
    probes: list[dict[str, Any]] = []

    def probe() -> None:
        got = run_trial({"contender": "limit", "workload": workload, "num_envs": main_envs},
                        float(cfg["trial_timeout"]))
        if got.get("ok"):
            probes.append(got)

    probe()
    limit = dict(probes[0]) if probes else {"ok": False, "error": "the cost probe failed"}
    costs = Costs.from_dict(limit["costs"]) if probes else None
    if costs is not None:
        c = costs
        log(f"costs: env step {c.env_wall_s * 1e6:,.1f} us wall / {c.env_cpu_s * 1e6:,.1f} us CPU, policy "
            f"{c.infer_at(1) * 1e6:.1f} us/sample at 1 row, {c.infer_at(main_envs) * 1e6:.2f} at {main_envs} "
            f"({c.engine}), worker loop {c.loop_step_s * 1e6:.1f} us + {c.loop_env_s * 1e6:.2f} us/env, "
            f"wake-up {c.hop_s * 1e6:.1f} us")
    else:
        log(f"costs: FAILED: {limit.get('error')}")
    trials: list[dict[str, Any]] = []
    started = time.monotonic()
    total = len(plan) * int(cfg["repeats"])
    for repeat in range(int(cfg["repeats"])):
        if repeat:
            probe()
        order = plan if repeat % 2 == 0 else list(reversed(plan))
        for contender, num_envs in order:
            spec = {"contender": contender, "workload": workload, "num_envs": num_envs,
                    "warmup": float(cfg["warmup"]), "seconds": float(cfg["seconds"])}
            result = run_trial(spec, float(cfg["trial_timeout"]))
            fps = _fps(result)
            trials.append({"contender": contender, "num_envs": num_envs, "repeat": repeat, "fps": fps, **result})
            shown = f"{fps:12,.0f} fps" if fps is not None else f"FAILED: {result.get('error')}"
            if result.get("choice"):
                shown += f"  (auto: {result['choice']}; predicted {result['predicted_fps']:,.0f}"
                trained = result.get("plan_predicted_fps")
                if trained is not None and abs(trained - result["predicted_fps"]) > 0.5:
                    shown += f", {trained:,.0f} with its trainer"
                shown += ")"
            log(f"  [{len(trials)}/{total}, {time.monotonic() - started:4.0f} s] repeat {repeat + 1}/{cfg['repeats']} "
                f"{contender:36s} envs={num_envs:<4d} {shown}")

    summary: dict[str, dict[int, dict[str, Any]]] = {}
    for contender, num_envs in plan:
        runs = [t for t in trials if t["contender"] == contender and t["num_envs"] == num_envs]
        values = [t["fps"] for t in runs if t["fps"] is not None]
        entry: dict[str, Any] = {"runs": len(runs), "ok": len(values)}
        if values:
            entry.update(median=statistics.median(values), min=min(values), max=max(values))
            for key in ("server_avg_batch_size", "worker_env_frac", "worker_infer_wait_frac", "worker_chunk_wait_frac"):
                got = [t[key] for t in runs if t.get(key) is not None]
                if got:
                    entry[key] = statistics.median(got)
        else:
            entry["error"] = runs[-1].get("error") if runs else "not run"
        ok_runs = [t for t in runs if t["fps"] is not None]
        own = [t["predicted_fps"] for t in ok_runs if t.get("predicted_fps")]
        if own:  # ours:auto, ours:train: each trial probed and predicted its own run; their median against the median run
            entry["predicted"] = statistics.median(own)
        elif costs is not None and ok_runs:
            entry["predicted"] = predicted_fps(contender, ok_runs[-1], num_envs, costs)
        choices = [t["choice"] for t in runs if t.get("choice")]
        if choices:
            entry["choice"] = choices[-1]
        commands = [t["command"] for t in runs if t.get("command")]
        if commands:
            entry["command"] = commands[-1]
        summary.setdefault(contender, {})[num_envs] = entry

    # The machine limit: every CPU busy with env CPU time and inference at the largest batch
    # the envs allow, or every env always stepping (an env that waits is bounded by its wall time).
    best_ours = max((c for c in contenders if c.startswith("ours:") and summary[c][main_envs].get("median")),
                    key=lambda c: summary[c][main_envs]["median"], default=None)
    if probes:
        costs = min_costs([Costs.from_dict(p["costs"]) for p in probes])
        limit.update(costs=costs.as_dict(), env_step_s=costs.env_wall_s, env_cpu_s=costs.env_cpu_s,
                     probes=len(probes))
        for name, by_n in summary.items():  # predictions from the same, least disturbed costs
            for num_envs, entry in by_n.items():
                ok_runs = [t for t in trials if t["contender"] == name and t["num_envs"] == num_envs and t["fps"]]
                if any(t.get("predicted_fps") for t in ok_runs):
                    continue  # ours:auto and ours:train keep their trials' own predictions
                if ok_runs and entry.get("predicted") is not None:
                    entry["predicted"] = predicted_fps(name, ok_runs[-1], num_envs, costs)
    if costs is not None:
        batch = min(main_envs, 256)
        limit["served_batch_size"] = batch
        limit["per_sample_at_served_s"] = costs.infer_at(batch)
        limit["fps"] = machine_limit(costs, main_envs, batch)
        limit["cpu_bound_fps"] = costs.cpus / (costs.env_cpu_s + costs.infer_at(batch))
        limit["wait_bound_fps"] = main_envs / costs.env_wall_s

    report = {
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "workload": workload, "num_envs": main_envs, "machine": machine(), "config": cfg,
        "summary": {c: {str(n): e for n, e in by_n.items()} for c, by_n in summary.items()},
        "best_ours": best_ours, "limit": limit, "notes": notes, "trials": trials,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench_{workload.get('name', 'workload')}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    log(format_report(report))
    log(f"report: {path}")
    return report


def format_report(report: dict[str, Any]) -> str:
    main = str(report["num_envs"])
    summary = report["summary"]

    def median(name: str, n: str = main) -> float | None:
        return summary.get(name, {}).get(n, {}).get("median")

    references = [(name, median(name)) for name in ("gym_sync", "gym_async", "torchrl_auto", "torchrl_driver",
                                                         "bare_procs")]
    references = [(name, value) for name, value in references if value]
    limit = report["limit"].get("fps") if report["limit"].get("ok") else None
    m = report["machine"]
    lines = [
        f"workload {report['workload'].get('name')}: {main} envs; {m['cpu']} ({m['cpus']} CPUs), "
        f"python {m['python']}, torch {m['torch']}",
        "",
        "| contender | frames/s (median) | min..max | predicted | " + " | ".join(f"x {n}" for n, _ in references)
        + (" | % of limit |" if limit else " |"),
        "|---|---:|---|---:|" + "---:|" * len(references) + ("---:|" if limit else ""),
    ]
    for name, by_n in summary.items():
        entry = by_n.get(main)
        if entry is None:
            continue
        if not entry.get("median"):
            lines.append(f"| {name} | failed: {entry.get('error', '?')} |")
            continue
        value = entry["median"]
        predicted = f"{entry['predicted']:,.0f}" if entry.get("predicted") else "-"
        label = f"{name} ({entry['choice']})" if entry.get("choice") else name
        row = f"| {label} | {value:,.0f} | {entry['min']:,.0f}..{entry['max']:,.0f} | {predicted} | "
        row += " | ".join(f"{value / ref:.2f}" for _, ref in references)
        row += f" | {100 * value / limit:.0f}% |" if limit else " |"
        lines.append(row)
    if limit:
        lim = report["limit"]
        lines += ["", f"machine limit {limit:,.0f} frames/s = min({lim['cpus']} CPUs / ({lim['env_cpu_s'] * 1e6:.1f} us "
                      f"env step CPU + {lim['per_sample_at_served_s'] * 1e6:.2f} us inference per sample at "
                      f"{lim['served_batch_size']} rows, {lim['engine']} engine) = {lim['cpu_bound_fps']:,.0f}, "
                      f"{report['num_envs']} envs / {lim['env_step_s'] * 1e6:,.1f} us step wall time = "
                      f"{lim['wait_bound_fps']:,.0f})"]
    sweep = {n for by_n in summary.values() for n in by_n if n != main}
    if sweep:
        lines += ["", *format_sweep(report), "", "best over env counts " + ", ".join(sorted({main, *sweep}, key=int)) + ":"]
        for name, by_n in summary.items():
            ok = {n: e["median"] for n, e in by_n.items() if e.get("median")}
            if len(by_n) > 1 and ok:
                best = max(ok, key=ok.get)
                lines.append(f"  {name:36s} {ok[best]:12,.0f} frames/s at {best} envs")
    commands = [(name, by_n[main]["command"]) for name, by_n in summary.items() if by_n.get(main, {}).get("command")]
    if commands:
        lines += ["", f"the commands whose collectors ours measured ({main} envs; other counts change env.num_envs):"]
        lines += [f"  {name}: {text}" for name, text in commands]
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)


#: the references a sweep's rows are divided by, when they ran
SWEEP_REFERENCES = ("gym_sync", "bare_procs")


def format_sweep(report: dict[str, Any]) -> list[str]:
    """One row per env count: each swept contender's median, ours' predictions, and ours over the references."""
    summary = report["summary"]
    counts = sorted({n for by_n in summary.values() for n in by_n}, key=int)
    swept = [name for name, by_n in summary.items() if len(by_n) > 1]
    ours = [name for name in swept if name.startswith("ours:")]
    refs = [name for name in SWEEP_REFERENCES if name in swept]
    head = ["envs", *swept, *(f"{name} predicted" for name in ours),
            *(f"{o} x {r}" for o in ours for r in refs)]
    lines = ["frames/s (median) by env count:", "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for n in counts:
        def median(name: str) -> float | None:
            return summary.get(name, {}).get(n, {}).get("median")

        cells = [n]
        cells += [f"{median(name):,.0f}" if median(name) else "-" for name in swept]
        for name in ours:
            predicted = summary.get(name, {}).get(n, {}).get("predicted")
            cells.append(f"{predicted:,.0f}" if predicted else "-")
        for o in ours:
            for r in refs:
                cells.append(f"{median(o) / median(r):.2f}" if median(o) and median(r) else "-")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines
