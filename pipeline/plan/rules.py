"""Every ``auto`` rule of the plan, one pure function each, and nothing else.

The runner's plan (:mod:`pipeline.plan.resolve`), the Ray hosts' plan
(:mod:`pipeline.plan.ray`) and, through them, the benchmark's ``ours:*``
contenders decide with these functions and no copy of them, so a number
measured anywhere is the number of a graph ``python -m pipeline`` builds.
Each returns a :class:`~pipeline.plan.choice.Choice`: the value, the branch
that gave it and the facts it used; :mod:`pipeline.plan.render` writes the
sentence the plan prints for it.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.plan.choice import Choice

#: Models the numpy serving engine has a copy of (with an MLP encoder).
NUMPY_MODELS = ("components.models.ActorCritic", "components.models.QNetwork")
#: the built-in actor-critic with a recurrent core (``model.rnn``): what ``model._target_`` ActorCritic becomes
RECURRENT_MODEL = "components.recurrent.RecurrentActorCritic"
#: trainer=sac's served actor (its critics are the trainer's own)
SAC_ACTOR = "components.sac_models.SquashedGaussianActor"

#: Fewest transitions per message that chunking=auto gives process workers and Ray hosts:
#: below that the driver's per-message work competes with training.
AUTO_MIN_TRANSITIONS = 64


def device(value: str, cuda: bool) -> Choice[str]:
    """``device.*=auto`` -> cuda when the machine has one, else cpu; anything else as given."""
    if value == "auto":
        return Choice("cuda", "auto.cuda") if cuda else Choice("cpu", "auto.no_cuda")
    return Choice(value, "given")


def envs_per_worker(requested: int | None, num_envs: int, workers: str, cpus: int,
                    server: str = "process") -> Choice[int]:
    """How many envs one worker hosts, and why.

    Thread workers share the GIL, so one worker steps them all and sends one
    request. Process workers get one worker per CPU, minus one CPU for the
    inference server: measured on 2 CPUs (Pong, 16 envs), one worker that
    alternates two blocks of 8 ran 1.4x faster than two workers of 8, which
    left a CPU idle whenever both waited for the server. With the policy
    inline there is no server to leave a CPU to: one worker per CPU.
    """
    if requested is not None:
        return Choice(min(int(requested), num_envs), "given", {"workers": workers})
    if workers == "thread":
        return Choice(num_envs, "auto.one_thread_worker", {"num_envs": num_envs})
    count = min(num_envs, max(1, cpus if server == "inline" else cpus - 1))
    code = "auto.worker_per_cpu" if server == "inline" else "auto.cpu_left_for_server"
    return Choice(math.ceil(num_envs / count), code, {"workers": count, "cpus": cpus})


def worker_threads(server: str, server_threads: int) -> int:
    """Threads of each process worker's pools: its policy copy's (``server.num_threads`` with server=inline), else one.

    A worker that only steps envs has no use for a pool, and one per CPU in
    every worker is what made 1,024 CartPole envs 4x slower than 256 (see
    :mod:`components.threads`).
    """
    return int(server_threads) if server == "inline" else 1


def chunk_len(num_envs: int, frames_per_batch: int, fewest: int, most: int | None = None) -> Choice[int]:
    """``chunking=auto`` for process workers and Ray hosts: steps per message.

    ``fewest`` / ``most``: the envs of the smallest / largest sender (a
    worker or a host). At least :data:`AUTO_MIN_TRANSITIONS` transitions
    from the smallest; a quarter of each env's share of a batch when that is
    longer; never more than a batch from the largest. The quarter: senders
    buffer one batch plus a chunk ahead, so a chunk as long as the batch let
    them run two batches ahead (PPO's policy lag 2, which measurably slowed
    CartPole's learning); with a quarter it measured 1.3-1.5.

    The code says which bound decided: ``auto.fewest_transitions``,
    ``auto.quarter_batch`` or ``auto.one_batch``.

    Examples:
        >>> chunk_len(64, 1024, 32).value, chunk_len(64, 4096, 32).value, chunk_len(2, 64, 1).value
        (4, 16, 64)
        >>> chunk_len(64, 4096, 32).code, chunk_len(2, 32, 1).code, chunk_len(4, 128, 4).code
        ('auto.quarter_batch', 'auto.one_batch', 'auto.fewest_transitions')
    """
    most = fewest if most is None else most
    quarter = max(1, frames_per_batch // num_envs // 4)
    at_least = math.ceil(AUTO_MIN_TRANSITIONS / max(1, fewest))
    at_most = max(1, frames_per_batch // max(1, most))
    steps = max(1, min(max(at_least, quarter), at_most))
    code = ("auto.one_batch" if steps == at_most and at_most < max(at_least, quarter) else
            "auto.quarter_batch" if quarter > at_least else "auto.fewest_transitions")
    return Choice(steps, code, {"fewest": fewest, "most": most, "quarter": quarter,
                                "min_transitions": AUTO_MIN_TRANSITIONS})


def serving_engine(engine: str, model_target: str, encoder: str, policy_device: str,
                   spaces: str | None = None) -> Choice[str]:
    """``server.engine`` resolved (the numpy engine covers the built-in MLP networks on the CPU).

    Measured: numpy serves a 64-row CartPole batch in ~54 us, torch in ~149 us.
    ``spaces``: why the env's spaces have no numpy engine (categorical
    observations, multi-part actions), or None when they have one.
    """
    if engine != "auto":
        return Choice(engine, "given")
    builtin = model_target in NUMPY_MODELS
    if policy_device == "cpu" and builtin and encoder == "mlp" and spaces is None:
        return Choice("numpy", "auto.small_mlp_on_cpu")
    facts = {"device": policy_device, "encoder": encoder, "model": model_target, "spaces": spaces}
    code = ("auto.torch_device" if policy_device != "cpu" else "auto.torch_encoder" if builtin and encoder != "mlp"
            else "auto.torch_spaces" if builtin else "auto.torch_model")
    return Choice("torch", code, facts)


def numpy_spaces(env_spec: Any) -> str | None:
    """Why ``env_spec``'s spaces have no numpy engine (None: they have one, or the spec is not known yet)."""
    if env_spec is None:
        return None
    if env_spec.obs_kind in ("discrete", "multi_discrete"):
        return "categorical observations (one-hot encoded)"
    if env_spec.obs_kind == "tree":
        return "Dict/Tuple observations"
    if env_spec.action_kind in ("multi_discrete", "multi_binary"):
        return f"{env_spec.action_kind} actions"
    return None
