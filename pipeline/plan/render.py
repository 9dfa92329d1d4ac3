"""Every sentence the plan prints, written from the choices' codes and facts (and nowhere else).

The resolver (:mod:`pipeline.plan.resolve`), the Ray plan
(:mod:`pipeline.plan.ray`) and the rules (:mod:`pipeline.plan.rules`) only
decide; this module explains. One function per plan line reads a
:class:`~pipeline.plan.choice.Choice` and returns its sentence, so a
sentence changes in one place and a test can check a decision by its code
without parsing English.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.plan.choice import Choice


def device(choice: Choice[str]) -> str:
    """Why a device was chosen (``given``: the device's own name)."""
    if choice.code == "auto.cuda":
        return "auto -> cuda: a CUDA device is available"
    if choice.code == "auto.no_cuda":
        return "auto -> cpu: no CUDA device on this machine"
    if choice.code == "inline.cpu":
        return f"server=inline -> cpu: each worker runs its copy of the policy on its CPU ({device(choice.facts['asked'])})"
    return str(choice.value)


def _device_named(choice: Choice[str]) -> str:
    return str(choice.value) if choice.code == "given" else f"{choice.value} ({device(choice)})"


def engine(choice: Choice[str]) -> str:
    if choice.code == "auto.small_mlp_on_cpu":
        return "auto -> numpy: a small MLP on the CPU (numpy serves a 64-row CartPole batch in ~54 us, torch in ~149 us)"
    if choice.code.startswith("auto.torch"):
        f = choice.facts
        why = {"auto.torch_device": f"the policy runs on {f.get('device')}",
               "auto.torch_encoder": f"encoder {f.get('encoder')}",
               "auto.torch_spaces": f"the env's {f.get('spaces')} have no numpy engine",
               "auto.torch_model": f"{f.get('model')} has no numpy copy"}[choice.code]
        if f.get("model") == "components.recurrent.RecurrentActorCritic":
            why = "a recurrent core (model.rnn) has no numpy copy"
        return f"auto -> torch: {why}"
    return str(choice.value)


def envs_per_worker(choice: Choice[int]) -> str:
    n, f = choice.value, choice.facts
    if choice.code == "given":
        return f"{f['workers']} workers of {n} envs"
    if choice.code == "auto.one_thread_worker":
        return f"auto -> one thread worker steps all {f['num_envs']} envs (threads share the GIL)"
    why = "each with its own policy (server=inline)" if choice.code == "auto.worker_per_cpu" else \
        "one CPU left for inference"
    return f"auto -> {n} envs per worker: {f['workers']} worker process(es) on {f['cpus']} CPUs, {why}"


def blocks(choice: Choice[int]) -> str:
    if choice.code == "inline.one_block":
        return "1 block per worker (inline answers within the call: nothing to overlap)"
    if choice.code.startswith("concurrent"):
        text = "each env in its own thread, served as it returns (none waits for another's step)"
        if choice.code == "concurrent.splits_reset":
            text += f"; workers.splits={choice.facts['asked']} -> 1 (no blocks to alternate)"
        return text
    return f"{choice.value} block(s) per worker"


def workers(choice: Choice[str]) -> str:
    f = choice.facts
    if choice.code == "ray.hosts":
        hosts: Choice[int] = f["hosts"]
        count = (f"auto -> {hosts.value}: one per {hosts.facts['cpus_per_host']:g} CPU(s) of the cluster's "
                 f"{hosts.facts['cluster_cpus']:g}, at most num_envs") if hosts.code == "auto.per_cpu" else f"{hosts.value}"
        resources = f", resources {f['resources']}" if f["resources"] else ""
        local = "one worker thread" if f["local_workers"] == "thread" else "worker processes"
        return (f"ray: {count} env host(s) (Ray actors of {f['cpus_per_host']:g} CPU(s), {f['scheduling']} "
                f"placement{resources}), {f['per_host']} envs each stepped by {local}")
    per_worker: Choice[int] = f["per_worker"]
    if choice.code == "measured":
        return (f"auto (measured) -> {per_worker.facts['workers']} {choice.value} worker(s) of up to "
                f"{per_worker.value} envs, {blocks(f['blocks'])}")
    return f"{envs_per_worker(per_worker)}; {blocks(f['blocks'])}"


def transport(choice: Choice[str]) -> str:
    f = choice.facts
    slots = "every worker reaches the server's shared-memory slots directly"
    if choice.code == "inline":
        return "none: server=inline evaluates the policy inside each env worker, no request ever leaves the worker"
    if choice.code == "given":
        return f"slots: {slots}"
    if choice.code == "auto.slots":
        return f"auto -> slots: {slots}"
    if choice.code == "auto.slots_server_to_process":
        return (f"auto -> slots: {slots}; server=thread -> process (env workers are processes; transport=slots "
                "server=thread keeps it in the driver)")
    if choice.code == "auto.slots_server_unshareable":
        return (f"auto -> slots: {slots}; server stays a driver thread: policy_device={f['policy_device']} cannot "
                "be shared with a process")
    if choice.code == "ray.object_refs":
        frames = ", ".join(str(n) for n in f["chunk_frames"])
        return (f"Ray object refs: {chunking(f['chunk'])} ({frames} transitions), 1-{f['in_flight']} chunk "
                "request(s) in flight per host (one batch made ahead at most); weights: one ray.put per update")
    layout, rows = f["layout"], f["rows"]
    return (f"auto (measured) -> {layout.describe(f['num_envs'])}: predicted {layout.predicted_fps:,.0f} frames/s "
            f"({layout.bound}-bound; limit {f['limit']:,.0f}); env step {f['env_wall_s'] * 1e6:,.1f} us wall / "
            f"{f['env_cpu_s'] * 1e6:,.1f} us CPU, policy {f['infer_s'] * 1e6:.2f} "
            f"us/sample at {rows:.3g} row{'' if rows == 1 else 's'} ({f['engine']}), wake-up {f['hop_s'] * 1e6:.1f} us"
            + (f", trainer {f['trainer_s'] * 1e6:,.1f} us/frame" if f["trainer_s"] else ""))


def server(choice: Choice[str]) -> str:
    f = choice.facts
    where = {"process": "a dedicated process", "thread": "a driver thread",
             "inline": "every env host (its own copy)" if f.get("hosts")
             else f"each of the {f['workers']} env worker(s) (its own copy)"}[choice.value]
    split = (f"; a {f['per_worker']}-env block exceeds max_batch_size, so it is served in {f['passes']} passes"
             if f["passes"] > 1 else "")
    batching = (f"one forward per block of up to {f['rows']} rows{split}" if choice.value == "inline" else
                f"batches of {f['min_batch']}..{f['max_batch']} rows{split}")
    return f"{choice.value}: policy on {_device_named(f['device'])} in {where}, {batching}; engine {engine(f['engine'])}"


def chunking(choice: Choice[int]) -> str:
    f, unit = choice.facts, choice.facts.get("unit", "message")
    if choice.code == "fixed":
        return f"fixed: {choice.value} steps per {unit}"
    if choice.code == "step":
        return f"step: every step is a {unit}" + (" (a round trip per step: slow)" if unit == "chunk" else "")
    if choice.code == "lockstep":
        return (f"{choice.value} steps per {unit}: the longest up to the planned {f['planned'].value} that divides "
                f"a batch's {f['turns']} steps per env (deterministic=true)")
    if choice.code == "ray.chunk_len":
        return f"ray.chunk_len: {choice.value} steps per chunk"
    if choice.code == "auto.thread_workers":
        return "auto -> 1 step per message: thread workers have no process boundary to amortise"
    senders = f"{f['fewest']}" if f["most"] == f["fewest"] else f"{f['fewest']}-{f['most']}"
    return (f"auto -> {choice.value} steps x {senders} envs per message: at least {f['min_transitions']} "
            f"transitions, a quarter of frames_per_batch // num_envs ({f['quarter']} steps) when larger, "
            "never above a batch")


def devices(choice: Choice[tuple[str, str, str]]) -> str:
    policy, trainer, storing = choice.value
    trainer_choice: Choice[str] = choice.facts["trainer"]
    note = f" ({device(trainer_choice)})" if trainer_choice.code != "given" else ""
    return f"policy {policy}, trainer {trainer}, batches stored on {storing}{note}"


def frame_dedup(choice: Choice[bool | None]) -> str:
    f = choice.facts
    if choice.code == "auto.pending":
        return "auto (decided from the env's observations)"
    leaves = f.get("leaves")
    if choice.code == "auto.on" and leaves:
        return (f"auto -> on: image leaf {', '.join(repr(n) for n in leaves)} ({f['shape']} uint8), each frame "
                "stored once, the rest of the observation whole")
    if choice.code == "auto.on":
        return f"auto -> on: {f['shape']} uint8 frame stacks, each frame stored once"
    if choice.code == "auto.off" and leaves is not None:
        return "auto -> off: the Dict/Tuple observation has no uint8 image leaf of at least 36x36"
    if choice.code == "auto.off":
        return f"auto -> off: {f['shape']} {f['dtype']} observations are not uint8 frame stacks"
    return str(f["word"])


def replay(choice: Choice[str]) -> str:
    f = choice.facts
    where = "memory" if f["storage"] == "memory" else "memory-mapped files in the run directory"
    return (f"{choice.value}, {f['capacity']} transitions in {where}, frame dedup {frame_dedup(f['dedup'])}, "
            "written by a background writer thread")


def trainer(choice: Choice[str]) -> str:
    f = choice.facts
    target = f["target_return"]
    return (f"{choice.value}: {f['frames_per_batch']} frames per batch, stop at {f['total_frames']} frames"
            + (f" or a mean return >= {target} over {f['target_window']} episodes" if target is not None else "")
            + ("; batches hold each observation once, successors only where a trajectory is cut"
               if f.get("cut_successors") else ""))


def collector(choice: Choice[None]) -> str:
    f = choice.facts
    parts = [f"stall timeout {f['stall_timeout']:g} s" if f["stall_timeout"] is not None else "no stall timeout"]
    parts += [text for flag, text in (
        (f["yield_completed_trajectories"], "yields completed trajectories"),
        (f["reset_at_each_iter"], "resets every env after each batch"),
        (f["post_collect_hook"], f"hook {f['post_collect_hook']}"),
        (f["driver_affinity"], f"driver threads on CPUs {f['driver_affinity']}"),
        (f["policy_version"], f"initial policy version {f['policy_version']}")) if flag]
    return ", ".join(parts)


def threads(choice: Choice[int]) -> str:
    """What each kind of process's BLAS/OpenMP/torch pools hold."""
    f = choice.facts
    if choice.code == "ray":
        return (f"driver {f['torch_threads']} (torch_threads: trainer), each env host 1 (its envs and policy "
                "copy in turn), metric sinks 1; pinned in each process")
    workers, server = f["workers"], f["server"]
    parts = [f"driver {f['torch_threads']} (torch_threads: trainer"
             + (", thread workers" if workers == "thread" else "")
             + (", inference thread" if server == "thread" else "")
             + (", inline policy" if server == "inline" and workers == "thread" else "") + ")"]
    if workers == "process":
        parts.append(f"{f['num_workers']} env worker process(es) {choice.value} each"
                     + (" (server.num_threads: each runs its policy copy)" if server == "inline" else ""))
    if server == "process":
        parts.append(f"inference process {f['server_threads']} (server.num_threads)")
    parts.append("metric sinks 1")
    return ", ".join(parts) + "; pinned in each process before numpy or torch loads"


def determinism(choice: Choice[bool]) -> str:
    f = choice.facts
    off = "; workers.concurrent_envs=true turned off" if f["concurrent_off"] else ""
    every = f.get("checkpoint_frames")
    off += (f"; a checkpoint every {every} frames, each a restart point (fresh envs: a resume from it is the same "
            "run)" if every else "; checkpoints only at the end (checkpoint.frames: resumable ones)")
    if f["restarts_off"]:
        off += f"; worker restarts off (workers.max_restarts={f['restarts_off']}: a relaunched env cannot be replayed)"
    return (f"deterministic: each batch is {f['turns']} steps of all {f['num_envs']} envs, asked for by the trainer "
            "and served by the weights it just published (no collection during updates: slower); one forward per "
            f"worker block; the layout by rule, not measured; metric rows at frame counts, evaluations waited "
            f"for{off}")


def cpus(choice: Choice[int]) -> str:
    f = choice.facts
    return (f"sized for {choice.value} of {f['total']} CPU(s): {f['jobs']} sweep jobs run at once "
            "(hydra.launcher.n_jobs)")


def preset(choice: Choice[str]) -> str:
    f = choice.facts
    line = _preset(choice)
    if "target" not in f:
        return line
    own = (f"{f['target']:g}, {f['env_id']}'s reward_threshold in gymnasium's registry" if f["target"] is not None
           else f"null: {f['env_id']} has no reward_threshold in gymnasium's registry, the run goes to total_frames")
    return (f"{line}; " if line else "") + f"target_return {own} (the {f['target_was']:g} is {f['measured_on']}'s)"


def _preset(choice: Choice[str]) -> str:
    f = choice.facts
    if choice.code == "defaults":
        return ""
    rechosen = (f"{f['env_id']} is a {f['family']} env, so env=gym runs as env={f['family']}"
                if f.get("family") else "")
    if choice.code == "applied":
        return f"specialize/{choice.value}.yaml: {f['summary']}" + (f" ({rechosen})" if rechosen else "")
    if choice.code == "family_without_preset":
        return f"none for trainer={f['trainer']}: {rechosen}, which has no {f['trainer']} preset"
    return (f"none: {f['env_id']} is a {f['family']} env; env={f['family']} env.id={f['env_id']} applies "
            f"specialize/{f['file']}.yaml")


def tasks(choice: Choice[int]) -> str:
    parts = [f"{name} {count} env(s)" + (f" (seeds +{offset})" if offset else "")
             for name, count, offset in choice.facts["entries"]]
    return f"{choice.value} task(s), one policy: " + ", ".join(parts) + "; episode/<task>/* metrics for each"


def masks(choice: Choice[str]) -> str:
    where = (f"info[{choice.value!r}] of every reset and step, moved into the observation" if choice.code == "info"
             else f"the observation's {choice.value!r} leaf")
    use = ("masked max in its targets" if choice.facts["trainer"] == "dqn"
           else "masked log-probs and entropy in PPO")
    return (f"{where} (env.action_mask_key): actions are drawn and taken greedily among the allowed ones; "
            f"{use}")


def memory(choice: Choice[str]) -> str:
    f = choice.facts
    seq = (f" BPTT sequences of up to {f['seq_len']} steps (trainer.seq_len);" if f.get("seq_len")
           else " BPTT over each env's whole trajectories in a batch (trainer.seq_len=null);")
    trunks = "one trunk for both heads" if f["trunks"] == 1 else "the actor's and the critic's"
    return (f"{choice.value} core, {f['layers']} x {f['hidden']} ({trunks}): {f['state_bytes']:,} B of state per env, "
            "carried "
            f"in each request (with is_first) and back in each response (+{f['slot_bytes']:,} B per slot); each chunk "
            f"row records the state acted with and the next one (+{f['row_bytes']:,} B a row, "
            f"+{f['chunk_bytes']:,} B a chunk);{seq} workers.concurrent_envs off")


def evaluation(choice: Choice[int]) -> str:
    e = choice.facts["settings"]
    text = (f"every {choice.value:,} frames and at the end: {e.episodes} episode(s), {e.mode.name.lower()}, on envs "
            "of their own in a background thread (collection never waits)")
    if e.envs:
        text += f"; also on {', '.join(e.envs)} (eval.envs, eval/<name>/*)"
    if e.video is not None:
        v = e.video
        every = "every evaluation" if v.every == 1 else f"every {v.every}th evaluation"
        fps = f"{v.fps} fps" if v.fps else "the env's fps"
        text += (f"; a video of {v.episodes} episode(s) at {every} and the final one, up to {v.max_steps:,} frames "
                 f"an episode at {fps}: videos/<frames>.mp4, TensorBoard, wandb, the report")
    return text


def cluster(choice: Choice[Any]) -> str:
    return str(choice.facts["described"])


def envs(choice: Choice[int]) -> str:
    f = choice.facts
    if choice.code == "ray":
        return f"envs      {choice.value} in {f['hosts']} ray env host(s) of {f['per_host']}"
    return f"envs      {choice.value} in {f['workers']} {f['kind']} worker(s) of up to {f['per_worker']}"


#: plan line -> its sentence
LINES: dict[str, Callable[[Choice], str]] = {
    "workers": workers, "cpus": cpus, "transport": transport, "server": server, "chunking": chunking,
    "device": devices, "replay": replay, "trainer": trainer, "collector": collector, "threads": threads,
    "preset": preset, "cluster": cluster, "tasks": tasks, "masks": masks, "mode": determinism,
    "memory": memory, "eval": evaluation,
}


def line(key: str, choice: Choice) -> str:
    return LINES[key](choice)


def plan_lines(plan: Any) -> list[str]:
    """The plan as printed: where the envs are, then one ``key  sentence`` line per choice."""
    out = [envs(plan.envs)] if plan.envs is not None else []
    return out + [f"{key:<9} {line(key, choice)}" for key, choice in plan.choices]
