"""The policy inside each env worker (``server=inline``): no other process on the hot path.

A central server pays a cross-process wake-up twice per step (request,
answer: ~25 us each on this machine) and makes every worker wait for the
slowest batch; for a small MLP on the CPU that costs more than evaluating
the policy where the observations already are. Here every worker holds its
own copy of the policy (the numpy engine for the built-in MLPs, torch with
one thread otherwise) and its action channels answer a request in the call
that submits it.

What stays as with a server: weights reach the workers through the same
versioned shared arena (:mod:`components.inference.weights`), polled
between two steps (one shared integer read) and copied in without its
lock, checked against the publish counter, so a step never acts with half
an update and a worker killed while copying blocks nobody; every response is stamped with
the ``policy_version`` that produced it; the interaction mode travels with
each request; and :meth:`InlineServer.stats` returns the server statistics'
keys (:data:`~components.inference.stats.STAT_KEYS`), summed over the
workers from a shared table each worker writes its own row of.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from components.action_noise import NOISE_KEY, noise_width
from components.inference.inline_stats import BATCHES, REQUESTS, RING, ROWS, UPDATES, VERSION, InlineStatsTable
from components.inference.stats import STAT_KEYS
from components.interaction import InteractionMode
from components.shm import FieldSpec

_NAN = float("nan")
#: the mode of a block whose every row samples (a collecting worker's): the numpy engine needs no mode rows then
_SAMPLE = int(InteractionMode.RANDOM)


class InlinePolicy:
    """One worker's copy of the policy; built lazily where the worker runs.

    Picklable before it is built, so a worker process receives a recipe
    and builds the copy itself; the worker's channels hold the same
    instance, so they share one copy and one RNG. Two kinds of recipe:

    * ``numpy_recipe`` (the built-in MLPs): which state-dict keys form which
      layers. The worker reads the weights as numpy arrays through a
      :class:`~components.inference.weights_reader.WeightsReader` and never
      imports torch (a second of CPU and ~190 MB per worker saved).
    * ``model_spec`` (any other model): the worker imports torch, builds the
      model and copies the weights into it.
    """

    def __init__(self, worker: int, model_spec: Any, env_spec: Any, engine: str, weights: Any,
                 stats: InlineStatsTable, seed: int, launch: int = 0,
                 numpy_recipe: dict[str, Any] | None = None, max_batch_size: int = 256) -> None:
        self.worker, self.model_spec, self.env_spec, self.engine_name = worker, model_spec, env_spec, engine
        self.weights, self.stats, self.seed, self.launch = weights, stats, seed, launch
        self.numpy_recipe = numpy_recipe
        #: most rows in one forward pass (server.max_batch_size): a larger block is evaluated in slices
        self.max_batch_size = max(1, int(max_batch_size))
        self._engine: Any = None
        self._model: Any = None
        self._arrays: dict[str, np.ndarray] | None = None
        self._seq, self._version = 0, 0
        self._versions, self._stamped = np.zeros(0, np.int64), -1  # the version it holds, as a Python int
        self._mode_rows: dict[tuple[int, int], np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_engine"] = state["_model"] = state["_arrays"] = None
        return state

    def _seed(self) -> int:
        return int(np.random.SeedSequence([self.seed, self.worker, self.launch]).generate_state(1)[0])

    def built_with(self, engine: Any) -> InlinePolicy:
        """This copy, built already and answering with ``engine`` (no weights read): the plan's loop probe."""
        self._engine, self._arrays = engine, {}
        return self

    def _build(self) -> None:
        self._version = int(self.stats.counters[self.worker, VERSION])
        deadline = time.monotonic() + 10.0
        if self.numpy_recipe is not None:
            from components.inference.numpy_engine import engine_from_recipe

            got = None
            while got is None:  # a publish in progress: wait for a clean copy (the first one always exists)
                got = self.weights.read(give_up_s=1.0)
                if got is None and time.monotonic() > deadline:
                    raise RuntimeError("no published policy weights could be read within 10 s")
            self._arrays, self._version, self._seq = got
            self._engine = engine_from_recipe(self.numpy_recipe, lambda: self._arrays, self._seed())
            self.stats.record_weights(self.worker, self._version)
            return
        import torch

        from components.inference.serving import serving_engine

        # torch's threads are the process's: a worker process's were pinned at its start (GraphSpec.worker_threads)
        torch.manual_seed(self._seed())
        self._model = self.model_spec.build(self.env_spec).eval()
        self._engine = serving_engine(self._model, self.engine_name, "cpu", "cpu", self._seed(),
                                      obs_leaves=self.env_spec.obs_leaves)
        while True:  # the copy built from the spec has its own random init: never act with it
            self.poll()
            if self._seq:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("no published policy weights could be read within 10 s")

    def poll(self) -> None:
        """Apply weights published since the last look: called between steps, never inside one."""
        weights = self.weights
        if weights.seq == self._seq:
            return
        if self._arrays is not None:
            got = weights.read(into=self._arrays)
            read = None if got is None else got[1:]
        else:
            read = weights.read_into(self._model)
        if read is None:
            return  # a publish is in progress: act with the weights we have, look again next step
        self._version, self._seq = read
        refresh = getattr(self._engine, "refresh", None)
        if refresh is not None:
            refresh()
        self.stats.record_weights(self.worker, self._version)

    def act(self, observation: np.ndarray, rows: int, mode: int,
            noise: np.ndarray | None = None, extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Actions for ``observation[:rows]``; ``noise``: the rows' sampling noise (components.action_noise);
        ``extra``: more request fields (a recurrent policy's state leaves and episode-start flags)."""
        if self._engine is None:
            self._build()
        else:
            self.poll()
        started = time.perf_counter()
        step = self.max_batch_size
        if rows <= step and self._arrays is not None:  # the common case: one pass of the numpy engine
            inputs = {"observation": observation[:rows]}
            if noise is not None:
                inputs[NOISE_KEY] = noise[:rows]
            # A block's rows share one mode; when they all sample, the numpy engine is told so by no mode rows
            # (None) and skips finding the greedy ones: a compare and an ``any``, ~5 us of a 16-env CartPole
            # block step's ~190 (python -m pipeline.bench.loop_time: 1.145 -> 1.118 of the hand loop's time).
            response = self._engine.act(inputs, None if mode == _SAMPLE else self._modes(rows, mode))
            passes = 1
        else:
            parts = []
            for first in range(0, rows, step):
                n = min(step, rows - first)
                inputs = {"observation": observation[first:first + n]}
                if noise is not None:
                    inputs[NOISE_KEY] = noise[first:first + n]
                for key, value in (extra or {}).items():
                    inputs[key] = value[first:first + n]
                out = self._engine.act(inputs, self._modes(n, mode))
                parts.append({k: (v if isinstance(v, np.ndarray) else v.numpy()) for k, v in out.items()})
            response = parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
            passes = len(parts)
        if rows > self._versions.shape[0] or self._stamped != self._version:  # no numpy scalar per call
            self._versions, self._stamped = np.full(max(rows, 64), self._version, np.int64), self._version
        response["policy_version"] = self._versions[:rows]
        self.stats.record(self.worker, rows, time.perf_counter() - started, passes)
        return response

    def _modes(self, rows: int, mode: int) -> np.ndarray:
        """``rows`` copies of ``mode`` (made once per size and mode: engines only read them)."""
        key = (rows, mode)
        modes = self._mode_rows.get(key)
        if modes is None:
            modes = self._mode_rows[key] = np.full(rows, mode, np.int8)
        return modes


class InlineChannel:
    """An action channel (``request``/``submit``/``wait``) answered in ``submit`` by the worker's own policy."""

    def __init__(self, policy: InlinePolicy, rows: int, observation: FieldSpec, noise_width: int = 0,
                 extra: tuple[FieldSpec, ...] = ()) -> None:
        self.policy, self.rows, self.observation, self.noise_width = policy, rows, observation, int(noise_width)
        #: more request fields, written by the worker as into a slot (a recurrent policy's state, components.recurrent)
        self.extra = tuple(extra)
        self.slot = None
        self._bind()

    def _bind(self) -> None:
        f = self.observation
        self.request = {f.name: np.zeros((self.rows, *f.shape), f.dtype)}
        self._noise = None
        if self.noise_width:  # written by the worker before each submit, as into a slot
            self._noise = self.request[NOISE_KEY] = np.full((self.rows, self.noise_width), 0.5, np.float32)
        self._extra = {e.name: np.zeros((self.rows, *e.shape), e.dtype) for e in self.extra}
        self.request.update(self._extra)
        self._response: dict[str, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"policy": self.policy, "rows": self.rows, "observation": self.observation,
                "noise_width": self.noise_width, "extra": self.extra, "slot": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    #: ``submit`` takes the observations wherever they are (a chunk row): no copy into ``request`` first
    acts_anywhere = True

    def submit(self, rows: int | None = None, mode: int | None = None, observation: np.ndarray | None = None,
               noise: np.ndarray | None = None) -> None:
        """Answer the request now; ``observation`` / ``noise``: where they lie, if not in :attr:`request`."""
        n = self.rows if rows is None else int(rows)
        where = self.request[self.observation.name] if observation is None else observation
        self._response = self.policy.act(where, n, 0 if mode is None else int(mode),
                                         self._noise if noise is None else noise, self._extra)

    def wait(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        if self._response is None:
            raise RuntimeError("wait() before submit() on an inline channel")
        response, self._response = self._response, None
        return response


class InlineServer:
    """The driver's side of ``server=inline``: publishes weights, reads statistics; nothing to run.

    It has the interface of :class:`~components.inference.server.InferenceServer`
    that the collector, its monitor and the runner use, so the rest of the
    graph does not know where the policy runs.
    """

    backend = "inline"
    pid = None
    error = None

    def __init__(self, model_spec: Any, env_spec: Any, config: Any, num_workers: int, ctx: Any,
                 template: Mapping[str, Any], policy_version: int = 0) -> None:
        from components.inference.weights import SharedWeights

        self.model_spec, self.env_spec, self.config = model_spec, env_spec, config
        self._initial_version = int(policy_version)
        self._weights = SharedWeights(template, ctx)
        # Every worker builds its copy from the spec; the driver's initial weights make them one policy.
        self._weights.publish(template, self._initial_version)
        self._stats = InlineStatsTable(num_workers, self._initial_version)
        from components.inference.serving import numpy_eligible, numpy_recipe

        self._engine = str(config.engine)
        probe = model_spec.build(env_spec)
        if self._engine == "auto":
            self._engine = "numpy" if numpy_eligible(probe, "cpu") is None else "torch"
        self._recipe = numpy_recipe(probe) if self._engine == "numpy" else None
        self._noise_width = noise_width(probe)
        from components.recurrent_state import state_fields, state_leaves

        self._state_fields = tuple(state_fields(state_leaves(probe)))
        self._launches = [0] * num_workers
        self._started = self._stopped = False
        self._read_at = time.monotonic()
        self._last = np.zeros_like(self._stats.counters)
        self._last_written = np.zeros_like(self._stats.written)
        self._last_stats: dict[str, float] | None = None

    @property
    def weights_channel(self) -> Any:
        return self._weights

    def channels(self, worker: int, split_sizes: tuple[int, ...], observation: FieldSpec) -> list[InlineChannel]:
        """Worker ``worker``'s channels, one per block, sharing one (new) policy copy."""
        if self._recipe is not None:  # numpy: the worker needs neither the model spec nor torch
            policy = InlinePolicy(worker, None, self.env_spec, "numpy", self._weights.reader(), self._stats,
                                  int(self.config.seed or 0), self._launches[worker], numpy_recipe=self._recipe,
                                  max_batch_size=self.config.max_batch_size)
        else:
            policy = InlinePolicy(worker, self.model_spec, self.env_spec, self._engine, self._weights, self._stats,
                                  int(self.config.seed or 0), self._launches[worker],
                                  max_batch_size=self.config.max_batch_size)
        self._launches[worker] += 1
        return [InlineChannel(policy, max(split_sizes), observation, self._noise_width, self._state_fields)
                for _ in split_sizes]

    def start(self, timeout: float = 0.0) -> InlineServer:
        self._started = True
        self._read_at = time.monotonic()
        return self

    @property
    def is_alive(self) -> bool:
        return not self._stopped

    @property
    def published_version(self) -> int:
        return self._weights.version if self._weights.seq else self._initial_version

    @property
    def policy_version(self) -> int:
        """The newest version a worker acts with now.

        Each worker applies new weights at its next step, so for a moment
        the others still stamp the previous version (every transition says
        which); the newest is what a central server would report, and a
        worker parked on a full chunk queue cannot hold it back.
        """
        return int(self._stats.counters[:, VERSION].max())

    def update_weights(self, weights: Any, version: int | None = None) -> int:
        from components.inference.weights import state_of

        label = self.published_version + 1 if version is None else int(version)
        self._weights.publish(state_of(weights), label)
        return label

    def stats(self, reset: bool = True, timeout: float = 0.0) -> dict[str, float]:
        """Server statistics' keys over every worker's policy since the last ``reset`` read."""
        now = time.monotonic()
        counters, written = self._stats.counters.copy(), self._stats.written.copy()
        delta = counters - self._last
        elapsed = now - self._read_at
        forwards = []
        for w in range(counters.shape[0]):
            new = int(written[w] - self._last_written[w])
            if new <= 0:
                continue
            end = int(written[w])
            idx = np.arange(max(end - min(new, RING), 0), end) % RING
            forwards.append(self._stats.forward[w, idx])
        seconds = np.concatenate(forwards) if forwards else np.zeros(0)
        requests, rows = float(delta[:, REQUESTS].sum()), float(delta[:, ROWS].sum())
        batches = float(delta[:, BATCHES].sum())
        rate = 1.0 / elapsed if elapsed > 0 else 0.0
        p50, p95 = (np.percentile(seconds, [50, 95]) * 1e3).tolist() if seconds.size else (_NAN, _NAN)
        out = {
            "requests": requests, "batches": batches, "rows": rows,
            "weight_updates": float(delta[:, UPDATES].sum()),
            "requests_per_s": requests * rate, "batches_per_s": batches * rate, "rows_per_s": rows * rate,
            "interval_s": elapsed,
            "avg_batch_size": rows / batches if batches else _NAN,
            "avg_requests_per_batch": 1.0 if requests else _NAN,
            # answered in the call that asked: no queue
            "queue_latency_p50_ms": 0.0 if requests else _NAN, "queue_latency_p95_ms": 0.0 if requests else _NAN,
            "forward_p50_ms": p50, "forward_p95_ms": p95,
            "policy_version": float(self.policy_version),
            "requests_total": float(counters[:, REQUESTS].sum()), "batches_total": float(counters[:, BATCHES].sum()),
            "rows_total": float(counters[:, ROWS].sum()),
            "weight_updates_total": float(counters[:, UPDATES].sum()),
        }
        if reset:
            self._last, self._last_written, self._read_at = counters, written, now
        self._last_stats = out
        return {key: out[key] for key in STAT_KEYS}

    def shutdown(self, timeout: float = 0.0) -> None:
        self._stopped = True

    def __enter__(self) -> InlineServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
