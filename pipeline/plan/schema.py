"""Structured-config schemas, one per config group, registered in Hydra's ConfigStore.

Every option file in ``conf/<group>/`` starts with ``defaults: [base_<group>]``,
so a misspelt key or a wrong type fails at compose time, before anything
starts. Value checks that need more than a type (ranges, cross-group rules,
the machine) live in :mod:`pipeline.plan.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from components.kinds import (Activation, RecurrentCore, ChunkingMode, Direction, Encoder, EngineKind, RayScheduling, ReplayKind,
                              ReplayStorage, ServerKind, TransportKind, WandbMode, WorkerKind, WorkersBackend)
from components.trainers.settings import DQNConfig, PPOConfig, SACConfig


@dataclass
class EnvSchema:
    #: short label of the env option, used in the plan and sweep directory names (a run's own directory names the env it steps)
    name: str = MISSING
    #: gymnasium id
    id: str = MISSING
    #: environments in total
    num_envs: int = 8
    #: environments one worker hosts (null: auto, see the plan)
    envs_per_worker: int | None = None
    #: ``_target_`` of a ``() -> gymnasium.Env`` factory (or of a function returning one: a lambda or closure reaches
    #: process workers by value)
    factory: Any = MISSING
    #: an env set instead of env.factory: a list of {factory: {_target_: ...}, count: N, task: name, seed_offset: K}
    #: (task: the metrics' name, default task<i>; the counts sum to num_envs; every entry makes the same spaces)
    factories: list[Any] | None = None
    #: the action mask's name: a top-level key of a Dict observation, or of the info dict (read on a reset at plan
    #: time); True entries are the allowed actions (Discrete and MultiDiscrete; null: never mask)
    action_mask_key: str | None = "action_mask"


@dataclass
class ModelSchema:
    _target_: str = "components.models.ActorCritic"
    #: mlp (vector observations) or nature_cnn (uint8 image stacks)
    encoder: Encoder = Encoder.mlp
    #: hidden widths of the MLP encoder
    hidden: list[int] = field(default_factory=lambda: [64, 64])
    #: width of the CNN's feature layer
    features: int = 512
    #: initial log standard deviation of Gaussian action heads (actor-critics)
    init_log_std: float = 0.0
    #: normalise observations with running mean/std kept in the weights (actor-critics, mlp encoder)
    obs_norm: bool = False
    #: clip normalised observations to [-obs_clip, obs_clip]
    obs_clip: float = 10.0
    #: hidden-layer activation: tanh or relu
    activation: Activation = Activation.tanh
    #: a recurrent core between the encoder and the heads: lstm or gru (null: feed-forward); PPO trains it on
    #: trainer.seq_len-step sequences, each env's state travelling with its requests (components/recurrent.py)
    rnn: RecurrentCore | None = None
    #: units of each recurrent layer
    rnn_hidden: int = 128
    #: stacked recurrent layers
    rnn_layers: int = 1


@dataclass
class WorkersSchema:
    #: auto (thread or process, as transport=auto measures), thread (in the driver), process (spawned,
    #: one per block) or ray (env hosts on a Ray cluster, see ray.*)
    backend: WorkersBackend = WorkersBackend.auto
    #: blocks a worker steps alternately, one request each (2: double-buffered)
    splits: int = 1
    #: auto (as transport=auto measures), true (every env of a worker steps in its own thread and is served
    #: as it returns: for envs whose step mostly waits) or false (a worker steps its envs one after another)
    concurrent_envs: str = "auto"
    #: CPU sets for process workers, used round-robin (null: OS decides)
    affinity: list[list[int]] | None = None
    #: niceness increment of process workers (0-19): they yield to the server and trainer
    nice: int = 0
    #: seconds a worker may spend in one env step, or without progress anywhere (frozen: a deadlock, a stopped
    #: process), before it counts as hung: a process is killed and restarted, a thread stops the run (null: never)
    step_timeout: float | None = 60.0
    #: restarts of a crashed or hung worker (fresh envs) within restart_window before the run fails
    max_restarts: int = 3
    #: seconds over which max_restarts is counted
    restart_window: float = 300.0


@dataclass
class TransportSchema:
    #: auto or slots: every worker reaches the server's shared-memory slots (auto also places the server)
    kind: TransportKind = TransportKind.auto


@dataclass
class ServerSchema:
    #: thread (in the driver), process (dedicated inference process) or inline (a policy copy in every env worker)
    backend: ServerKind = ServerKind.thread
    #: most observation rows per forward pass
    max_batch_size: int = 256
    #: rows to wait for (up to timeout) before a forward pass
    min_batch_size: int = 1
    #: seconds to keep draining while below min_batch_size
    timeout: float = 0.002
    #: samples kept per logging interval for latency/forward percentiles (counters are exact)
    stats_reservoir: int = 2048
    #: torch threads of a server process
    num_threads: int = 1
    #: how the policy is evaluated: auto (numpy for small MLPs on the CPU), torch, numpy
    engine: EngineKind = EngineKind.auto
    #: CUDA only: pad batches to this many rows and replay a captured CUDA graph (null: off)
    static_batch_size: int | None = None
    #: times a dead inference server is restarted (latest weights, all workers with fresh envs) per run
    max_restarts: int = 1
    #: seconds the server may make no progress while requests wait before it counts as hung (null: never);
    #: a server process is then killed and restarted within max_restarts, a server thread stops the run
    step_timeout: float | None = 60.0


@dataclass
class DeviceSchema:
    """Placement of the policy, the trainer and stored data.

    Env workers, shared buffers and server responses always live in host
    memory, so there is no key for them.
    """

    #: where the served policy runs: cpu, cuda, cuda:N or auto
    policy_device: str = "cpu"
    #: where the trainer's model and losses live: cpu, cuda, cuda:N or auto
    trainer_device: str = "cpu"
    #: where collected batches and in-memory replay are stored (replay.storage=disk: cpu)
    storing_device: str = "cpu"


@dataclass
class CollectorSchema:
    #: seconds without a completed chunk while the trainer waits before the run stops (null: never)
    stall_timeout: float | None = 60.0
    #: yield whole finished trajectories, at least frames_per_batch transitions per yield
    yield_completed_trajectories: bool = False
    #: end (truncate) every env's episode at its next step after each batch
    reset_at_each_iter: bool = False
    #: dotted path of a callable run on every batch before replay or the trainer (null: none)
    post_collect_hook: str | None = None
    #: CPUs for the driver-side threads: server thread, thread workers, replay writer (null: any)
    driver_affinity: list[int] | None = None
    #: version label of the initial weights (the trainer counts on from it)
    policy_version: int = 0


@dataclass
class ChunkingSchema:
    #: auto, step (1 step per message) or fixed (size steps per message)
    mode: ChunkingMode = ChunkingMode.auto
    #: steps per message when mode=fixed
    size: int | None = None
    #: chunk buffers per worker (null: enough to run one batch ahead)
    chunks_per_worker: int | None = None


@dataclass
class ReplaySchema:
    #: none (on-policy: learn from each batch once), uniform or prioritized
    kind: ReplayKind = ReplayKind.none
    #: memory (preallocated tensors) or disk (memory-mapped files in the run directory)
    storage: ReplayStorage = ReplayStorage.memory
    #: transitions kept (circular overwrite)
    capacity: int = 100_000
    #: store each frame of uint8 frame stacks once: auto (when observations, or a Dict's image leaves, are stacks), true, false (any case)
    frame_dedup: str = "auto"
    #: prioritized: priority exponent
    alpha: float = 0.6
    #: prioritized: initial importance-sampling exponent, annealed to 1
    beta: float = 0.4
    #: prioritized: added to |TD error| so no priority is zero
    eps: float = 1e-6
    #: samples older than this many policy versions are not returned (null: no filter)
    max_policy_lag: int | None = None
    #: a memory replay goes into each checkpoint while its rows take at most this many MB (null: never; a disk
    #: replay is always saved, by reference to its files; deterministic=true always saves it)
    checkpoint_max_mb: float | None = 1024.0


@dataclass
class PPOSchema(PPOConfig):
    _target_: str = "components.trainers.ppo.PPOTrainer"


@dataclass
class DQNSchema(DQNConfig):
    _target_: str = "components.trainers.dqn.DQNTrainer"


@dataclass
class SACSchema(SACConfig):
    _target_: str = "components.trainers.sac.SACTrainer"


@dataclass
class LoggerSchema:
    _target_: str = "components.metrics.MetricsLogger"
    #: of jsonl (always written), tensorboard (<run dir>/tb), wandb (<run dir>/wandb)
    sinks: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard", "wandb"])
    #: seconds between logged (and printed) rows
    interval: float = 5.0
    #: at least this many rows over the budget (not printed; at most 4 per second; 0: interval only)
    rows_per_run: int = 50
    #: wandb project
    project: str = "rlpipeline"
    #: wandb entity (user or team; null: wandb's default)
    entity: str | None = None
    #: wandb group (null: a sweep's jobs are grouped by the sweep directory's name)
    group: str | None = None
    #: wandb tags
    tags: list[str] = field(default_factory=list)
    #: wandb job type (null: train, or sweep for a job of a multirun)
    job_type: str | None = None
    #: seconds wandb may take to start, and the sinks process to take the summary and close every sink at the
    #: end of the run (wandb's finish included), before the run goes on without it (the process is killed)
    wandb_timeout: float = 60.0
    #: wandb mode: offline, online or disabled (null: $WANDB_MODE, else offline)
    mode: WandbMode | None = None
    #: false: tensorboard and wandb write from a child process, so their Python never takes the
    #: driver's GIL from the trainer (measured: the default CartPole loop 8.6 s -> 7.0 s); true: in the driver
    in_process: bool = False
    #: more sinks, as module.Class paths: each is built as Class(run_dir) in the sinks process and gets every row
    #: (log(row, frames)), the summary (summary(values)) and close(exit_code), as TensorBoard does
    extra_sinks: list[str] = field(default_factory=list)
    #: rows the sinks process may fall behind (a slow or stuck sink); past it rows are dropped for the sinks,
    #: never waited for (metrics.jsonl keeps every row): one warning, counted in logger/dropped_rows
    queue_rows: int = 256


@dataclass
class EvalSchema:
    """Evaluation episodes on envs of their own beside training, and videos of them (pipeline/runner/evaluation.py)."""

    #: frames between evaluations (null: none, or a tenth of trainer.total_frames with video=true;
    #: trainer.eval_interval, deprecated, still sets it)
    interval: int | None = None
    #: episodes per evaluation, played at once on that many envs
    episodes: int = 10
    #: how the evaluated policy acts: deterministic (greedy), mode, mean or random (sampled)
    mode: str = "deterministic"
    #: record videos of evaluation episodes (the eval envs render rgb_array frames; training envs never do)
    video: bool = False
    #: a video at every Nth evaluation (and always at the final one)
    video_every: int = 1
    #: episodes per video, one after the other (the first eval envs')
    video_episodes: int = 1
    #: frames per second of the videos (null: the env's render_fps, else 30)
    video_fps: int | None = None
    #: frames recorded per episode at most (the episode still plays to its end)
    video_max_steps: int = 1000
    #: more evaluation envs by name, each env-config overrides on top of env (e.g. {nosticky: {factory:
    #: {repeat_action_probability: 0.0}}}), logged under eval/<name>/
    envs: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckpointSchema:
    #: write checkpoint.pt (model, optimiser, counters, RNG, episode statistics; a disk replay's state)
    enabled: bool = True
    #: seconds between checkpoints during the run (null: only at the end; ignored when deterministic=true)
    interval: float | None = 60.0
    #: frames between checkpoints (null: none by frames); deterministic=true: restart points a resume repeats
    frames: int | None = None


@dataclass
class RunDirSchema:
    """Who may read a run directory, and taking over one this machine cannot check (pipeline/runner/rundir.py)."""

    #: private (directories 0700, files 0600: weights and stored observations stay yours), group (0750/0640)
    #: or shared (your umask, e.g. 0755/0644)
    mode: str = "private"
    #: take over a .run.lock naming a run on another host (or an old pid-file claim) you know is gone;
    #: never saved for a later resume
    take_over: bool = False


@dataclass
class SweepSchema:
    #: what a sweep job returns (the optuna sweeper optimises it): a key of the summary row
    objective: str = "episode/return_mean"
    #: maximize or minimize (the optuna study's direction unless hydra.sweeper.direction is given)
    direction: Direction = Direction.maximize


@dataclass
class RaySchema:
    """Where env hosts run with ``workers=ray`` (ignored otherwise)."""

    #: local (start a loopback-only cluster in this process), auto (join the cluster of this machine or
    #: RAY_ADDRESS), host:port (a cluster's GCS) or ray://host:port (Ray Client)
    address: str = "local"
    #: env-host actors (null: one per num_cpus_per_actor CPUs of the cluster, at most num_envs)
    num_actors: int | None = None
    #: CPUs each env host reserves (its envs and its copy of the policy run in them)
    num_cpus_per_actor: float = 1.0
    #: custom resources each env host needs, e.g. {env_node: 1} to place hosts on nodes that offer it
    resources: dict[str, float] = field(default_factory=dict)
    #: SPREAD (hosts on as many nodes as possible) or DEFAULT (Ray packs them)
    scheduling: RayScheduling = RayScheduling.SPREAD
    #: deprecated (a note says so): env steps per chunk; chunking=fixed chunking.size=N now says it for hosts too
    #: (null: the chunking group decides, as for process workers)
    chunk_len: int | None = None
    #: most chunk requests a host has outstanding (fewer while one batch is made ahead: that bounds the policy lag)
    in_flight: int = 2
    #: how a host steps its envs: thread (one worker thread) or process (one worker process per CPU)
    local_workers: WorkerKind = WorkerKind.thread
    #: seconds to start every env host (placement included) before the run fails
    start_timeout: float = 120.0
    #: Ray runtime_env for the hosts (e.g. {working_dir: .} when the cluster's nodes lack this project)
    runtime_env: dict[str, Any] = field(default_factory=dict)
    #: object store bytes of a cluster this run starts (null: Ray's default)
    object_store_memory: int | None = None


@dataclass
class Config:
    env: EnvSchema = MISSING
    model: ModelSchema = MISSING
    workers: WorkersSchema = MISSING
    transport: TransportSchema = MISSING
    server: ServerSchema = MISSING
    device: DeviceSchema = MISSING
    chunking: ChunkingSchema = MISSING
    collector: CollectorSchema = MISSING
    replay: Any = MISSING
    trainer: Any = MISSING
    logger: LoggerSchema = MISSING
    #: one seed for everything: env seeds, sampling, network init
    seed: int = 0
    #: torch intra-op threads of the driver (trainer, thread server); trainer=sac sets 2
    torch_threads: int = 1
    #: a reproducible run: lockstep collection, fixed batches, rows at frame counts (slower; docs/configuration.md)
    deterministic: bool = False
    #: show a progress bar
    progress: bool = True
    #: evaluation episodes and their videos
    eval: EvalSchema = MISSING
    #: checkpoints at the end and every checkpoint.interval seconds
    checkpoint: CheckpointSchema = field(default_factory=CheckpointSchema)
    #: a run directory to continue (its saved config and checkpoint; overrides apply on top)
    resume: str | None = None
    #: what a multirun job reports back
    sweep: SweepSchema = field(default_factory=SweepSchema)
    #: env hosts on a Ray cluster (workers=ray)
    ray: RaySchema = field(default_factory=RaySchema)
    #: run-directory permissions and claims
    rundir: RunDirSchema = field(default_factory=RunDirSchema)


def register() -> None:
    """Put every schema in Hydra's ConfigStore and the run-name resolvers in OmegaConf (idempotent).

    ``${rlp_suffix:}`` is a short random suffix for default run directory
    names: two runs started in the same second get two directories.
    ``${rlp_env_label:...}`` names the env a run steps (:func:`env_label`).
    """
    import secrets

    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("rlp_suffix"):
        OmegaConf.register_new_resolver("rlp_suffix", lambda: secrets.token_hex(3), use_cache=True)
    if not OmegaConf.has_resolver("rlp_env_label"):
        from pipeline.plan.run_name import env_label

        OmegaConf.register_new_resolver("rlp_env_label", env_label)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, name, node in (
        ("env", "base_env", EnvSchema),
        ("model", "base_model", ModelSchema),
        ("workers", "base_workers", WorkersSchema),
        ("transport", "base_transport", TransportSchema),
        ("server", "base_server", ServerSchema),
        ("device", "base_device", DeviceSchema),
        ("chunking", "base_chunking", ChunkingSchema),
        ("collector", "base_collector", CollectorSchema),
        ("replay", "base_replay", ReplaySchema),
        ("trainer", "base_ppo", PPOSchema),
        ("trainer", "base_dqn", DQNSchema),
        ("trainer", "base_sac", SACSchema),
        ("logger", "base_logger", LoggerSchema),
        ("eval", "base_eval", EvalSchema),
    ):
        cs.store(group=group, name=name, node=node)
