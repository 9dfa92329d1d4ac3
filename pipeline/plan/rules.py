"""Every ``auto`` rule of the plan, one pure function each, and nothing else.

The runner's plan (:mod:`pipeline.plan.resolve`), the Ray hosts' plan
(:mod:`pipeline.plan.ray`) and, through them, the benchmark's ``ours:*``
contenders decide with these functions and no copy of them, so a number
measured anywhere is the number of a graph ``python -m pipeline`` builds.
Each returns the value and the sentence the plan prints for it.
"""

from __future__ import annotations

import math

#: Models the numpy serving engine has a copy of (with an MLP encoder).
NUMPY_MODELS = ("components.models.ActorCritic", "components.models.QNetwork")

#: Fewest transitions per message that chunking=auto gives process workers and Ray hosts:
#: below that the driver's per-message work competes with training.
AUTO_MIN_TRANSITIONS = 64


def device(value: str, cuda: bool) -> tuple[str, str]:
    """``device.*=auto`` -> cuda when the machine has one, else cpu; anything else as given."""
    if value == "auto":
        if cuda:
            return "cuda", "auto -> cuda: a CUDA device is available"
        return "cpu", "auto -> cpu: no CUDA device on this machine"
    return value, value


def envs_per_worker(requested: int | None, num_envs: int, workers: str, cpus: int,
                    server: str = "process") -> tuple[int, str]:
    """How many envs one worker hosts, and why.

    Thread workers share the GIL, so one worker steps them all and sends one
    request. Process workers get one worker per CPU, minus one CPU for the
    inference server: measured on 2 CPUs (Pong, 16 envs), one worker that
    alternates two blocks of 8 ran 1.4x faster than two workers of 8, which
    left a CPU idle whenever both waited for the server. With the policy
    inline there is no server to leave a CPU to: one worker per CPU.
    """
    if requested is not None:
        return min(int(requested), num_envs), f"{workers} workers of {min(int(requested), num_envs)} envs"
    if workers == "thread":
        return num_envs, f"auto -> one thread worker steps all {num_envs} envs (threads share the GIL)"
    if server == "inline":
        count = min(num_envs, max(1, cpus))
        per_worker = math.ceil(num_envs / count)
        return per_worker, (f"auto -> {per_worker} envs per worker: {count} worker process(es) on {cpus} CPUs, "
                            "each with its own policy (server=inline)")
    count = min(num_envs, max(1, cpus - 1))
    per_worker = math.ceil(num_envs / count)
    return per_worker, (f"auto -> {per_worker} envs per worker: {count} worker process(es) on {cpus} CPUs, "
                        "one CPU left for inference")


def worker_threads(server: str, server_threads: int) -> int:
    """Threads of each process worker's pools: its policy copy's (``server.num_threads`` with server=inline), else one.

    A worker that only steps envs has no use for a pool, and one per CPU in
    every worker is what made 1,024 CartPole envs 4x slower than 256 (see
    :mod:`components.threads`).
    """
    return int(server_threads) if server == "inline" else 1


def chunk_len(num_envs: int, frames_per_batch: int, fewest: int, most: int | None = None) -> tuple[int, str]:
    """``chunking=auto`` for process workers and Ray hosts: steps per message, and why.

    ``fewest`` / ``most``: the envs of the smallest / largest sender (a
    worker or a host). At least :data:`AUTO_MIN_TRANSITIONS` transitions
    from the smallest; a quarter of each env's share of a batch when that is
    longer; never more than a batch from the largest. The quarter: senders
    buffer one batch plus a chunk ahead, so a chunk as long as the batch let
    them run two batches ahead (PPO's policy lag 2, which measurably slowed
    CartPole's learning); with a quarter it measured 1.3-1.5.

    Examples:
        >>> chunk_len(64, 1024, 32)[0], chunk_len(64, 4096, 32)[0], chunk_len(2, 64, 1)[0]
        (4, 16, 64)
    """
    most = fewest if most is None else most
    quarter = max(1, frames_per_batch // num_envs // 4)
    at_least = math.ceil(AUTO_MIN_TRANSITIONS / max(1, fewest))
    at_most = max(1, frames_per_batch // max(1, most))
    steps = max(1, min(max(at_least, quarter), at_most))
    senders = f"{fewest}" if most == fewest else f"{fewest}-{most}"
    return steps, (f"auto -> {steps} steps x {senders} envs per message: at least {AUTO_MIN_TRANSITIONS} "
                   f"transitions, a quarter of frames_per_batch // num_envs ({quarter} steps) when larger, "
                   "never above a batch")


def serving_engine(engine: str, model_target: str, encoder: str, policy_device: str) -> tuple[str, str]:
    """``server.engine`` resolved, and why (the numpy engine covers the built-in MLP networks on the CPU)."""
    if engine != "auto":
        return engine, engine
    builtin = model_target in NUMPY_MODELS
    if policy_device == "cpu" and builtin and encoder == "mlp":
        return "numpy", ("auto -> numpy: a small MLP on the CPU (numpy serves a 64-row CartPole batch "
                         "in ~54 us, torch in ~149 us)")
    why = (f"the policy runs on {policy_device}" if policy_device != "cpu" else
           f"encoder {encoder}" if builtin else f"{model_target} has no numpy copy")
    return "torch", f"auto -> torch: {why}"
