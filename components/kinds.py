"""The words a config may use for each kind of thing, listed once.

Each kind is a :class:`Word` enum. As the type of a structured-config field
(:mod:`pipeline.plan.schema`) it makes Hydra's composition reject any other
word, naming the allowed ones, before anything starts; the components that
take the word (:class:`~components.collector.graph.GraphSpec`, the inference
server, the serving engines) check against the same enum. A word is a
``str``: it compares, hashes, formats and serialises as its value, so code
that reads ``cfg.server.backend`` compares it with plain strings. Only the
standard library is imported: env-worker processes unpickle these.
"""

from __future__ import annotations

from enum import Enum


class Word(str, Enum):
    """An allowed word: a ``str`` whose ``str()`` is its value (not ``Kind.value``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __hash__(self) -> int:
        return str.__hash__(self)

    @classmethod
    def words(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)

    @classmethod
    def check(cls, key: str, value: object) -> str:
        """``value`` as one of the words, or a ValueError naming ``key`` and what is allowed."""
        if str(value) not in cls.words():
            raise ValueError(f"{key}={value!r}: must be one of {', '.join(cls.words())}")
        return str(value)


class WorkerKind(Word):
    """Where a collector's env workers run."""

    thread = "thread"
    process = "process"


class WorkersBackend(Word):
    """``workers.backend``: a worker kind, ``auto`` (the plan measures) or ``ray`` (env hosts on a cluster)."""

    auto = "auto"
    thread = "thread"
    process = "process"
    ray = "ray"


class ServerKind(Word):
    """Where the policy is served: a driver thread, its own process, or a copy inside every env worker."""

    thread = "thread"
    process = "process"
    inline = "inline"


class EngineKind(Word):
    """How the served policy is evaluated (``auto``: resolved by the plan)."""

    auto = "auto"
    torch = "torch"
    numpy = "numpy"


class TransportKind(Word):
    auto = "auto"
    slots = "slots"


class ChunkingMode(Word):
    auto = "auto"
    step = "step"
    fixed = "fixed"


class ReplayKind(Word):
    none = "none"
    uniform = "uniform"
    prioritized = "prioritized"


class ReplayStorage(Word):
    memory = "memory"
    disk = "disk"


class Encoder(Word):
    mlp = "mlp"
    nature_cnn = "nature_cnn"


class Activation(Word):
    tanh = "tanh"
    relu = "relu"


class RecurrentCore(Word):
    lstm = "lstm"
    gru = "gru"


class NanPolicy(Word):
    error = "error"
    skip = "skip"


class TargetMetric(Word):
    train = "train"
    eval = "eval"


class RayScheduling(Word):
    SPREAD = "SPREAD"
    DEFAULT = "DEFAULT"


class RunDirMode(Word):
    private = "private"
    group = "group"
    shared = "shared"


class Direction(Word):
    maximize = "maximize"
    minimize = "minimize"


class WandbMode(Word):
    offline = "offline"
    online = "online"
    disabled = "disabled"
