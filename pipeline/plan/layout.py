"""Choosing the collector layout by measurement: probe the costs, predict each layout, take the best.

``transport=auto`` used to pick a layout by rule (process workers -> a
server process, one CPU left for it). A rule cannot know whether the
policy costs more than a cross-process hop, or whether an env's step is
mostly CPU or mostly waiting. So the plan measures, in a few hundred
milliseconds, what decides it:

* one env step's wall time and the CPU time of the thread that stepped it
  (an env behind a socket or a renderer waits: wall >> CPU);
* the policy's cost per sample at a few batch sizes, with the engine the
  plan chose (numpy or torch);
* the worker loop's own cost per step and per env (a block of do-nothing
  envs stepped through :class:`~components.collector.env_block.EnvBlock`);
* this machine's cross-process wake-up: a ping-pong between two processes
  on the semaphores the slot transport uses.

:func:`predict` turns them into frames/s for each candidate (every CPU
layout: thread or process workers, a central server in a thread or a
process, or the policy inline; envs per worker), :func:`choose` takes the
best, and the plan prints the prediction next to the choice.
``python -m pipeline.bench`` reports predicted against measured, which
keeps the model honest. The model is deliberately simple (steady state, no
trainer): its job is to rank layouts, not to forecast to the percent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

#: Batch sizes the policy is timed at (per-sample cost is interpolated in log(batch) between them).
BATCHES = (1, 4, 16, 64, 256)
#: Inline worker processes per CPU at most with the torch engine: each imports torch for its policy
#: copy (~1 s of CPU to start, ~190 MB resident). The numpy engine needs no torch: no such cap.
INLINE_TORCH_PROCESSES_PER_CPU = 2
#: A cross-process wake-up where none can be measured (seconds; ~3-25 us on the machines measured).
DEFAULT_HOP_S = 25e-6
#: The most worker processes a layout may have: each is a Python interpreter with its own memory.
MAX_PROCESSES = 64
#: How busy one interpreter's GIL can be kept by many env threads taking turns (measured on the
#: waiting env: two worker processes of 32 env threads kept their cores 82 % busy, four of 16 kept
#: them 93 % busy and collected 7 % more).
CONCURRENT_GIL_BUSY = 0.8


@dataclass(frozen=True)
class Costs:
    """What one probe measured (seconds)."""

    env_wall_s: float
    env_cpu_s: float
    infer_s: dict[int, float]
    #: the worker loop's cost per step of a block (fixed part) and per env in it
    loop_step_s: float
    loop_env_s: float
    #: one cross-process wake-up (a semaphore released in one process, acquired in another)
    hop_s: float
    engine: str = "numpy"
    cpus: int = 1
    #: the trainer's CPU seconds per collected frame, on the driver's interpreter (0: collection only,
    #: as the benchmark measures it; see :func:`time_training` and :mod:`pipeline.plan.trainer_probe`)
    trainer_s: float = 0.0
    #: bytes of one observation, of one whole transition as stored, and what moving a byte through memory
    #: costs (a copy too big for the caches): what big frames add per frame (see :func:`predict`)
    obs_bytes: int = 0
    frame_bytes: int = 0
    copy_s_per_byte: float = 0.0
    #: the share of that copy rate a process keeps when every CPU copies at once (probed for big frames only)
    copy_share: float = 1.0

    @property
    def env_wait_s(self) -> float:
        """The part of an env step spent waiting (not on this CPU)."""
        return max(0.0, self.env_wall_s - self.env_cpu_s)

    @property
    def busy_copy_s_per_byte(self) -> float:
        """A byte's copy while the workers and the driver all move frames (what a run pays)."""
        return self.copy_s_per_byte / max(self.copy_share, 1e-3)

    @property
    def assembly_s(self) -> float:
        """The driver's CPU per frame to copy a transition out of its chunk into a batch."""
        return self.frame_bytes * self.busy_copy_s_per_byte

    @property
    def slot_copy_s(self) -> float:
        """A worker's CPU per frame to copy an observation into a central server's request slot."""
        return self.obs_bytes * self.busy_copy_s_per_byte

    @property
    def loop_env_busy_s(self) -> float:
        """The loop's per-env cost with its frame's write into the chunk slowed as :attr:`copy_share` says."""
        return self.loop_env_s + self.obs_bytes * (self.busy_copy_s_per_byte - self.copy_s_per_byte)

    def infer_at(self, batch: float) -> float:
        """Per-sample policy cost at ``batch`` rows (log-interpolated; flat beyond the ends)."""
        points = sorted(self.infer_s.items())
        if batch <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if batch <= b1:
                w = (math.log(batch) - math.log(b0)) / (math.log(b1) - math.log(b0))
                return t0 + w * (t1 - t0)
        return points[-1][1]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        """Inverse of :meth:`as_dict` (benchmark reports)."""
        return cls(d["env_wall_us"] / 1e6, d["env_cpu_us"] / 1e6,
                   {int(b): t / 1e6 for b, t in d["infer_us_per_sample"].items()}, d["loop_step_us"] / 1e6,
                   d["loop_env_us"] / 1e6, d["hop_us"] / 1e6, d.get("engine", "numpy"), int(d.get("cpus", 1)),
                   d.get("trainer_us", 0.0) / 1e6, int(d.get("obs_bytes", 0)), int(d.get("frame_bytes", 0)),
                   d.get("copy_ns_per_kb", 0.0) / 1e12, float(d.get("copy_share", 1.0)))

    def as_dict(self) -> dict[str, Any]:
        return {"env_wall_us": self.env_wall_s * 1e6, "env_cpu_us": self.env_cpu_s * 1e6,
                "infer_us_per_sample": {b: t * 1e6 for b, t in self.infer_s.items()},
                "loop_step_us": self.loop_step_s * 1e6, "loop_env_us": self.loop_env_s * 1e6,
                "hop_us": self.hop_s * 1e6, "engine": self.engine, "cpus": self.cpus,
                "trainer_us": self.trainer_s * 1e6, "obs_bytes": self.obs_bytes, "frame_bytes": self.frame_bytes,
                "copy_ns_per_kb": self.copy_s_per_byte * 1e12, "copy_share": self.copy_share}


@dataclass(frozen=True)
class Layout:
    """One candidate: where envs and policy run, how envs are grouped, and its predicted frames/s."""

    workers: str
    server: str
    envs_per_worker: int
    splits: int = 1
    predicted_fps: float = 0.0
    #: what bounds the prediction: "workers" (their own rounds: env waits, answers), "cpu", "server", "gil",
    #: "trainer" (a training run's learner alone)
    bound: str = ""
    detail: dict[str, float] = field(default_factory=dict, compare=False)
    #: every env of a worker steps in its own thread, served as it returns (``workers.concurrent_envs``)
    concurrent: bool = False

    def describe(self, num_envs: int) -> str:
        count = math.ceil(num_envs / self.envs_per_worker)
        where = {"inline": "the policy inline in each worker", "process": "a server process",
                 "thread": "a server thread"}[self.server]
        blocks = f", {self.splits} blocks each" if self.splits > 1 else ""
        envs = " (each in its own thread, stepping concurrently)" if self.concurrent else ""
        return f"{count} {self.workers} worker(s) of {self.envs_per_worker} envs{envs}{blocks}, {where}"


def machine_limit(costs: Costs, num_envs: int, batch: float | None = None) -> float:
    """Frames/s no layout can beat: every CPU busy with env CPU time and inference, or every env always stepping.

    ``min(cpus / (step CPU + inference per sample), num_envs / step wall time)``:
    the first bound is what the CPUs can do, the second what the envs can do
    when none ever waits for another (a mostly-waiting env is bounded by
    its own wall time, however many CPUs are idle).
    """
    per_sample = costs.infer_at(batch or num_envs)
    return min(costs.cpus / (costs.env_cpu_s + per_sample), num_envs / costs.env_wall_s)


def predict(layout: Layout, costs: Costs, num_envs: int) -> Layout:
    """``layout`` with its predicted steady-state frames/s (collection only, no trainer).

    Per round of a worker (every block stepped once), with ``n`` envs per
    block: the worker's CPU is ``n * env CPU + loop(n)``, its wall time adds
    the env waits and, with a central server, the answer's round trip.
    Frames/s is the smallest of: what each worker's rounds allow, what the
    CPUs allow (all busy parts over the cores), and what the server allows.
    Thread workers and a thread server share one interpreter (the GIL): all
    their CPU is serial. A training run adds the trainer (``costs.trainer_s``
    per frame): one thread of the driver, so it bounds frames/s by itself,
    takes its share of the CPUs, and shares the interpreter with whatever
    runs in the driver (measured on CartPole PPO: a PPO update took 1.6x
    longer with a thread worker beside it than with a process worker).

    Bytes count too: a frame is written once by its worker (part of the
    loop probe, which streams through chunk-sized memory), copied once more
    into a central server's request slot, and once by the driver into a
    batch, each at the probed cost of a copy out of the caches. On raw
    210x160x3 frames those copies are a third of a frame's CPU.
    """
    c = costs
    if layout.concurrent:
        return _predict_concurrent(layout, costs, num_envs)
    n_workers = math.ceil(num_envs / layout.envs_per_worker)
    block = layout.envs_per_worker / layout.splits
    loop = c.loop_step_s + c.loop_env_busy_s * block
    env_cpu = block * c.env_cpu_s
    env_wall = block * c.env_wall_s
    if layout.server == "inline":
        infer = block * c.infer_at(block)
        worker_cpu = env_cpu + loop + infer
        worker_wall = env_wall + loop + infer
        server_cpu_per_frame = 0.0
        hops_per_block = 0.0
    else:
        # The server batches what is ready: while it computes, the blocks it is not answering keep
        # stepping, so about half the blocks wait at a time (measured on Pong: two 8-env workers gave
        # the server batches of 8, not 16).
        batch = min(num_envs, 256, block * max(1.0, n_workers * layout.splits / 2))
        server_cpu_per_frame = c.infer_at(batch) + 2 * c.hop_s / block  # gather/scatter and the wake-ups
        hops_per_block = 2.0
        worker_cpu = env_cpu + loop + hops_per_block * c.hop_s + block * c.slot_copy_s
        # With splits, one block steps while the other's answer is computed: the wait overlaps.
        answer = 2 * c.hop_s + block * c.infer_at(batch)
        worker_wall = env_wall + loop + (answer if layout.splits == 1 else max(0.0, answer - env_wall - loop))
    frames_per_round = block
    per_worker = frames_per_round / worker_wall
    bounds = {"workers": n_workers * per_worker}
    # The driver copies every transition out of its chunk into a batch: CPU the workers do not get (a
    # 200 KB transition of raw frames took ~0.2 of a core at 10,000 frames/s).
    cpu_per_frame = worker_cpu / frames_per_round + server_cpu_per_frame + c.assembly_s
    if layout.workers == "process" and c.env_wait_s > 0 and n_workers > c.cpus:
        # A process that waits is woken again: a context switch, and its interpreter's caches refilled after
        # the other processes ran (measured on the waiting env: 64 one-env processes spent ~46 us per frame
        # beyond what the probes add up to, about two wake-ups).
        cpu_per_frame += 2 * c.hop_s / frames_per_round
    trainer = c.trainer_s
    if trainer > 0:
        bounds["trainer"] = 1.0 / trainer
    if layout.workers == "thread" and layout.server in ("thread", "inline"):
        bounds["gil"] = 1.0 / (cpu_per_frame + trainer)  # one interpreter: every part is serial
    elif layout.workers == "thread":  # workers in the driver, server in its own process
        bounds["gil"] = 1.0 / (worker_cpu / frames_per_round + trainer)
        bounds["server"] = 1.0 / server_cpu_per_frame
        bounds["cpu"] = c.cpus / (cpu_per_frame + trainer)
    else:
        bounds["cpu"] = c.cpus / (cpu_per_frame + trainer)
        if layout.server == "thread":  # in the driver, beside the trainer
            bounds["gil"] = 1.0 / (server_cpu_per_frame + trainer)
        if layout.server != "inline":
            bounds["server"] = 1.0 / server_cpu_per_frame
    return _with_bounds(layout, bounds)


def _with_bounds(layout: Layout, bounds: dict[str, float]) -> Layout:
    bound = min(bounds, key=bounds.get)
    return Layout(layout.workers, layout.server, layout.envs_per_worker, layout.splits, bounds[bound], bound,
                  {k: float(v) for k, v in bounds.items()}, layout.concurrent)


def _predict_concurrent(layout: Layout, costs: Costs, num_envs: int) -> Layout:
    """Workers whose envs each step in a thread, served by the worker's main thread as they return.

    Per frame, a worker spends the env's CPU, the hand-off of its action to
    the env's thread (a wake-up, about what a cross-process one costs), the
    row write, and its share of what the main thread spends per batch of
    returned envs: one wake-up, one loop pass, one policy call. All of a
    worker's Python runs under one GIL, so a worker does at most
    ``1 / (its CPU per frame)``; an env cycles in its step's wall time plus
    the main thread's turnaround.

    The batch: at least what returns during one turnaround; when the CPUs
    cannot keep every env stepping, the envs not stepping queue up (Little's
    law: ``envs * (1 - rate / wall-bound rate)``), and about half of them
    wait for the main thread, the rest for the GIL inside their own step
    (measured on the waiting env: batches of 2.2, 3.2 and 11 rows with 16,
    32 and 64 envs per worker).
    """
    c = costs
    per_worker = layout.envs_per_worker
    n_workers = math.ceil(num_envs / per_worker)
    hops = 2.0 if layout.server != "inline" else 0.0  # a batch's round trip to a central server
    batch, rate = 1.0, 0.0
    bounds: dict[str, float] = {}
    for _ in range(12):  # fixed point: the batch shapes the costs, the rate the batch
        turnaround = c.loop_step_s + batch * (c.infer_at(batch) + c.loop_env_busy_s) + (1 + hops) * c.hop_s
        cpu_per_frame = (c.env_cpu_s + c.hop_s + c.loop_env_busy_s
                         + (c.loop_step_s + (1 + hops) * c.hop_s + batch * c.infer_at(batch)) / batch)
        wall_bound = num_envs / (c.env_wall_s + c.hop_s + turnaround)
        if layout.workers == "thread":  # the env threads run in the driver: one GIL with the trainer
            bounds = {"workers": wall_bound, "gil": 1.0 / (cpu_per_frame + c.trainer_s)}
        else:
            bounds = {"workers": wall_bound, "gil": CONCURRENT_GIL_BUSY * n_workers / cpu_per_frame,
                      "cpu": c.cpus / (cpu_per_frame + c.assembly_s + c.trainer_s)}
        if c.trainer_s > 0:
            bounds["trainer"] = 1.0 / c.trainer_s
        if layout.server != "inline":
            bounds["server"] = 1.0 / (c.infer_at(batch * n_workers) + 2 * c.hop_s / batch)
        rate = min(bounds.values())
        returned = per_worker * turnaround / (c.env_wall_s + turnaround)
        queued = 0.5 * per_worker * max(0.0, 1.0 - rate / wall_bound)
        batch = min(float(per_worker), max(1.0, returned, queued))
    out = _with_bounds(layout, bounds)
    out.detail["batch"] = batch  # rows per policy call: what the plan quotes the policy's cost at
    return out


def candidate_layouts(num_envs: int, cpus: int, workers: str | None = None, engine: str = "numpy",
                      shareable: bool = True, concurrent: bool | None = None) -> list[Layout]:
    """Every layout worth predicting (``workers`` restricts the env backend).

    ``shareable``: the policy device can be shared with a server process.
    ``concurrent``: True offers only layouts whose envs step concurrently
    (process or thread workers), False none of those, None both kinds.
    """
    out: list[Layout] = []
    backends = [workers] if workers else ["thread", "process"]
    if "thread" in backends:
        out += [Layout("thread", server, num_envs) for server in ("inline", "thread", "process")]
        if num_envs >= 2:
            out.append(Layout("thread", "inline", num_envs, concurrent=True))
    if "process" in backends:
        counts = sorted({min(num_envs, k) for k in
                         (1, max(1, cpus - 1), cpus, 2 * cpus, 4 * cpus, 8 * cpus, num_envs)} - {0})
        for count in counts:
            if count > MAX_PROCESSES:
                continue
            per_worker = math.ceil(num_envs / count)
            if engine == "numpy" or count <= INLINE_TORCH_PROCESSES_PER_CPU * cpus:
                out.append(Layout("process", "inline", per_worker))
            # A server thread would share the driver's GIL with the trainer and the batch assembly
            # (measured on Pong: 1,346 frames/s against 1,492 for a server process); it remains for
            # policies a process cannot share (see pipeline.plan).
            for server in ("process",) if shareable else ("thread",):
                out.append(Layout("process", server, per_worker, 1))
                if per_worker >= 2:
                    out.append(Layout("process", server, per_worker, 2))
            if per_worker >= 2:
                servers = ("inline", "process") if shareable else ("inline",)
                out += [Layout("process", server, per_worker, concurrent=True) for server in servers]
    if concurrent is not None:
        out = [l for l in out if l.concurrent == concurrent]
    return out


#: predictions within this share of the best are ties (the model is not more precise than that)
NEAR_TIE = 0.95


def choose(costs: Costs, num_envs: int, workers: str | None = None,
           servers: Sequence[str] = ("inline", "thread", "process"),
           envs_per_worker: int | None = None, shareable: bool = True,
           concurrent: bool | None = None) -> tuple[Layout, list[Layout]]:
    """The best predicted layout among those with an allowed server, and every prediction (best first).

    Near-ties (within 5 %) go to the layout that would collect fastest with
    no trainer, then, among those within 5 % of that, to fewer processes.
    A trainer bound makes many layouts tie, and the trainer's figure moves
    most between runs (timed on the run's own update, the default command
    was predicted 17,334-20,780 frames/s on one day; the optimiser step that
    stood in before read 7.9 us a frame where CartPole PPO took 13.4):
    collection headroom costs nothing while the trainer binds (CartPole
    PPO, 64 envs, trained to 600,000 frames: one worker 8.8-12.4 s, two
    workers 8.6-9.0 s) and keeps the run fast when the trainer is quicker
    than probed. Processes cost memory and start-up time, so they break the
    remaining ties.
    """
    layouts = candidate_layouts(num_envs, costs.cpus, workers, costs.engine, shareable, concurrent)
    if envs_per_worker is not None:  # the user fixed the grouping: only placements and splits are open
        layouts = [Layout(l.workers, l.server, envs_per_worker, l.splits if envs_per_worker >= 2 else 1,
                          concurrent=l.concurrent) for l in layouts]
        layouts = list(dict.fromkeys(layouts))
    ranked = sorted((predict(layout, costs, num_envs) for layout in layouts if layout.server in servers),
                    key=lambda l: -l.predicted_fps)
    if not ranked:
        raise ValueError(f"no candidate layout for workers={workers} servers={list(servers)}")
    close = [l for l in ranked if l.predicted_fps >= NEAR_TIE * ranked[0].predicted_fps]
    if costs.trainer_s > 0 and len(close) > 1:
        alone = replace(costs, trainer_s=0.0)
        collects = [predict(l, alone, num_envs).predicted_fps for l in close]
        close = [l for l, fps in zip(close, collects) if fps >= NEAR_TIE * max(collects)]

    def processes(l: Layout) -> int:
        count = math.ceil(num_envs / l.envs_per_worker) if l.workers == "process" else 0
        return count + (l.server == "process")

    return min(close, key=lambda l: (processes(l), -l.predicted_fps)), ranked
