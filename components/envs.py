"""Environment factories and the spec a collector graph is laid out from.

Factories are small picklable dataclasses: a worker process receives the
factory, not an environment, and builds its envs itself. Only numpy and
gymnasium are imported here so env worker processes start in a fraction of a
second (no torch).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from components.obs_tree import ObsLeaf, UnsupportedSpace, packed_size, rebuild_space, tree_leaves, zero_row
from components.shm import FieldSpec


class EnvConfigError(ValueError):
    """An environment the user named cannot be built (bad id, missing extra)."""


#: observation kinds: a Box, a Discrete (one int64 scalar), a MultiDiscrete (int64 vector), a MultiBinary (int8),
#: a tree (a Dict/Tuple of those, carried as one packed uint8 row: see components.obs_tree)
OBS_KINDS = ("box", "discrete", "multi_discrete", "multi_binary", "tree")
#: action kinds: Discrete (an int64 scalar), Box (float32), MultiDiscrete (int64 vector), MultiBinary (int8)
ACTION_KINDS = ("discrete", "continuous", "multi_discrete", "multi_binary")
_SUPPORTED = ("Box, Discrete, MultiDiscrete or MultiBinary observations, or a Dict/Tuple of them; Discrete, Box, "
              "MultiDiscrete or MultiBinary actions")


@dataclass(frozen=True)
class EnvSpec:
    """What the rest of the graph needs to know about an env, without the env.

    ``action_kind`` is ``"discrete"`` (``action_n`` choices, int64 scalar
    actions), ``"continuous"`` (float32 vectors of ``action_shape`` within
    ``action_low``..``action_high``), ``"multi_discrete"`` (int64 arrays of
    ``action_shape``, component ``i`` in ``[0, action_nvec[i])``) or
    ``"multi_binary"`` (int8 0/1 arrays of ``action_shape``).
    ``obs_kind`` says how observations encode: ``box`` (values as they are),
    ``discrete`` / ``multi_discrete`` (categories: component ``i`` in
    ``obs_start[i] .. obs_start[i] + obs_nvec[i] - 1``, one-hot encoded by the
    default models), ``multi_binary`` (0/1 flags) or ``tree``: a Dict/Tuple
    space whose ``obs_leaves`` are packed into one ``uint8[obs_shape]`` row
    (:mod:`components.obs_tree`). ``action_mask`` names the tree leaf that
    says which actions are allowed (``components.action_masks``), if any.
    """

    obs_shape: tuple[int, ...]
    obs_dtype: str
    action_kind: str
    action_n: int = 0
    action_shape: tuple[int, ...] = ()
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()
    obs_kind: str = "box"
    #: categories per observation component (discrete kinds; flattened for a MultiDiscrete of any shape)
    obs_nvec: tuple[int, ...] = ()
    #: the first category of each observation component (gymnasium's ``start``)
    obs_start: tuple[int, ...] = ()
    #: choices per action component (multi_discrete, flattened)
    action_nvec: tuple[int, ...] = ()
    #: a tree observation's leaves, in packing order, and the tree paths that are Tuples
    obs_leaves: tuple[ObsLeaf, ...] = ()
    obs_tuples: tuple[tuple[str | int, ...], ...] = ()
    #: the name of the leaf holding the action mask (True: allowed), None without masks
    action_mask: str | None = None
    #: where the env gives it: ``"obs"`` (a leaf of its Dict observation) or ``"info"`` (moved into the tree)
    action_mask_source: str | None = None

    @property
    def is_tree(self) -> bool:
        return self.obs_kind == "tree"

    def leaf(self, name: str) -> ObsLeaf:
        return next(leaf for leaf in self.obs_leaves if leaf.name == name)

    @property
    def obs_bytes(self) -> int:
        """Bytes of one observation as the data plane carries it (a tree: its packed row)."""
        return int(np.prod(self.obs_shape, dtype=np.int64)) * np.dtype(self.obs_dtype).itemsize

    @property
    def mask_size(self) -> int:
        """Entries an action mask must have: one per choice (MultiDiscrete: per choice of each component)."""
        if self.action_kind == "discrete":
            return self.action_n
        if self.action_kind == "multi_discrete":
            return sum(self.action_nvec)
        return 0

    @property
    def action_dtype(self) -> str:
        return {"discrete": "int64", "multi_discrete": "int64", "multi_binary": "int8"}.get(self.action_kind, "float32")

    @property
    def categorical_obs(self) -> bool:
        """Observations are categories (Discrete, MultiDiscrete): encoded one-hot, not as numbers."""
        return self.obs_kind in ("discrete", "multi_discrete")

    def zero_observation(self) -> np.ndarray:
        """An observation every space of this kind contains: zeros, or each component's first category."""
        if self.categorical_obs:
            return np.asarray(self.obs_start, np.int64).reshape(self.obs_shape)
        if self.is_tree:
            row = zero_row(self.obs_leaves)
            if self.action_mask is not None:  # every action allowed: a model's check batch must be actable
                from components.obs_tree import leaf_view

                leaf_view(row, self.leaf(self.action_mask))[...] = 1
            return row
        return np.zeros(self.obs_shape, self.obs_dtype)

    def zero_actions(self, rows: int) -> np.ndarray:
        """``rows`` actions of this spec (zeros: in every action space of its kind but a Box that excludes 0)."""
        return np.zeros((rows, *self.action_shape), self.action_dtype)

    def spaces(self) -> tuple[Any, Any]:
        """Gymnasium observation and action spaces this spec reads back from (probes and fake envs)."""
        from gymnasium import spaces

        shape = self.obs_shape
        if self.is_tree:
            obs: Any = rebuild_space(self.obs_leaves, self.obs_tuples)
        elif self.obs_kind == "discrete":
            obs = spaces.Discrete(self.obs_nvec[0], start=self.obs_start[0])
        elif self.obs_kind == "multi_discrete":
            obs = spaces.MultiDiscrete(np.reshape(self.obs_nvec, shape), start=np.reshape(self.obs_start, shape))
        elif self.obs_kind == "multi_binary":
            obs = spaces.MultiBinary(list(shape))
        elif np.dtype(self.obs_dtype).kind == "f":
            obs = spaces.Box(-np.inf, np.inf, shape, np.dtype(self.obs_dtype))
        else:
            info = np.iinfo(np.dtype(self.obs_dtype))
            obs = spaces.Box(info.min, info.max, shape, np.dtype(self.obs_dtype))
        if self.action_kind == "discrete":
            action: Any = spaces.Discrete(max(1, self.action_n))
        elif self.action_kind == "multi_discrete":
            action = spaces.MultiDiscrete(np.reshape(self.action_nvec, self.action_shape))
        elif self.action_kind == "multi_binary":
            action = spaces.MultiBinary(list(self.action_shape))
        else:
            action = spaces.Box(np.reshape(np.asarray(self.action_low, np.float32), self.action_shape),
                                np.reshape(np.asarray(self.action_high, np.float32), self.action_shape), dtype=np.float32)
        return obs, action

    def observation_field(self, name: str = "observation") -> FieldSpec:
        return FieldSpec(name, self.obs_shape, self.obs_dtype)

    def action_field(self) -> FieldSpec:
        return FieldSpec("action", self.action_shape, self.action_dtype)

    @classmethod
    def from_env(cls, env: Any) -> EnvSpec:
        """Read the spec off a constructed gymnasium env (a space it cannot carry is one EnvConfigError line)."""
        from gymnasium import spaces

        obs_space, act_space = env.observation_space, env.action_space
        obs: dict[str, Any]
        if isinstance(obs_space, spaces.Box):
            obs = {"obs_shape": tuple(obs_space.shape), "obs_dtype": np.dtype(obs_space.dtype).name}
        elif isinstance(obs_space, spaces.Discrete):
            obs = {"obs_shape": (), "obs_dtype": "int64", "obs_kind": "discrete", "obs_nvec": (int(obs_space.n),),
                   "obs_start": (int(obs_space.start),)}
        elif isinstance(obs_space, spaces.MultiDiscrete):
            obs = {"obs_shape": tuple(obs_space.shape), "obs_dtype": "int64", "obs_kind": "multi_discrete",
                   "obs_nvec": tuple(int(n) for n in np.ravel(obs_space.nvec)),
                   "obs_start": tuple(int(s) for s in np.ravel(obs_space.start))}
        elif isinstance(obs_space, spaces.MultiBinary):
            obs = {"obs_shape": tuple(obs_space.shape), "obs_dtype": "int8", "obs_kind": "multi_binary"}
        elif isinstance(obs_space, (spaces.Dict, spaces.Tuple)):
            try:
                leaves, tuples = tree_leaves(obs_space)
            except UnsupportedSpace as err:
                raise EnvConfigError(f"{err}; supported: {_SUPPORTED}") from None
            obs = {"obs_shape": (packed_size(leaves),), "obs_dtype": "uint8", "obs_kind": "tree",
                   "obs_leaves": leaves, "obs_tuples": tuples}
        else:
            raise EnvConfigError(f"observation space {obs_space} is not supported ({_SUPPORTED})")
        spec = cls._actions_of(obs, act_space)
        mask = getattr(env, "action_mask_leaf", None)  # set by components.action_masks.ActionMaskWrapper
        if mask is None:
            return spec
        from components.action_masks import MaskError, checked_mask_spec

        try:
            return checked_mask_spec(spec, mask, getattr(env, "action_mask_source", "obs"))
        except MaskError as err:
            raise EnvConfigError(str(err)) from None

    @classmethod
    def _actions_of(cls, obs: dict[str, Any], act_space: Any) -> EnvSpec:
        from gymnasium import spaces

        if isinstance(act_space, spaces.Discrete):
            if int(act_space.start) != 0:
                raise EnvConfigError(f"action space {act_space}: a Discrete space with start={act_space.start} is "
                                     "not supported (actions are 0..n-1)")
            return cls(**obs, action_kind="discrete", action_n=int(act_space.n))
        if isinstance(act_space, spaces.Box):
            return cls(**obs, action_kind="continuous", action_shape=tuple(act_space.shape),
                       action_low=tuple(float(x) for x in np.ravel(act_space.low)),
                       action_high=tuple(float(x) for x in np.ravel(act_space.high)))
        if isinstance(act_space, spaces.MultiDiscrete):
            if np.any(np.asarray(act_space.start) != 0):
                raise EnvConfigError(f"action space {act_space}: a MultiDiscrete space with a non-zero start is "
                                     "not supported (component i is 0..nvec[i]-1)")
            return cls(**obs, action_kind="multi_discrete", action_shape=tuple(act_space.shape),
                       action_nvec=tuple(int(n) for n in np.ravel(act_space.nvec)))
        if isinstance(act_space, spaces.MultiBinary):
            return cls(**obs, action_kind="multi_binary", action_shape=tuple(act_space.shape))
        raise EnvConfigError(f"action space {act_space} is not supported ({_SUPPORTED})")


def env_seeds(seed: int, num_envs: int, restart: int = 0) -> list[int]:
    """Distinct, independent seeds for every env, derived from one run seed.

    ``SeedSequence.spawn`` gives statistically independent streams, so seed 0
    and seed 1 never share an env seed the way ``seed + i`` schemes do.
    ``restart`` > 0 gives the fresh envs of a restarted worker new streams.
    """
    children = np.random.SeedSequence([seed, restart] if restart else seed).spawn(num_envs)
    return [int(child.generate_state(1, dtype=np.uint32)[0]) for child in children]


_MUJOCO_SEEN: set[str] = set()


def _mujoco_warning(message: str) -> None:
    """MuJoCo's warning hook: each distinct message once per process, to logging.

    MuJoCo's default hook appends every warning to ``MUJOCO_LOG.TXT`` in the
    current directory and prints it; gymnasium's v5 models trigger a compiler
    deprecation warning on every env built, so a run with 16 envs would print
    it 16 times and litter the directory the user ran from. Deprecations of
    the bundled models are not the user's to act on: they go to debug level.
    """
    text = str(message).strip()
    if text in _MUJOCO_SEEN:
        return
    _MUJOCO_SEEN.add(text)
    level = logging.DEBUG if "deprecated" in text else logging.WARNING
    logging.getLogger("mujoco").log(level, "mujoco: %s", text)


def _install_mujoco_warning_hook(env_id: str) -> None:
    import gymnasium as gym

    try:
        entry_point = str(gym.spec(env_id).entry_point)
    except Exception:  # noqa: BLE001 - an unknown id fails later, with its own message
        return
    if "mujoco" not in entry_point:
        return
    import mujoco

    if mujoco.get_mju_user_warning() is None:
        mujoco.set_mju_user_warning(_mujoco_warning)


def _ensure_registered(env_id: str) -> None:
    """Register ale-py's ids when ``env_id`` may be one: every ``ALE/`` id, and any id not registered yet.

    ale-py registers its classic ids too (PongNoFrameskip-v4, Breakout-v4) in gymnasium's default
    namespace, but only when imported: without this they read as unknown ("did you mean Ant-v4?").
    """
    import gymnasium as gym

    _install_mujoco_warning_hook(env_id)
    ale = env_id.startswith("ALE/")
    if not ale and env_id in gym.registry:
        return
    try:
        import ale_py
    except ImportError as err:
        if ale:
            raise EnvConfigError(f"env id {env_id!r} needs ale-py: pip install 'rlpipeline[atari]'") from err
        return  # not an ALE id after all: check_env_id names it
    gym.register_envs(ale_py)


def check_env_id(env_id: str) -> None:
    """Fail with one clear line when ``env_id`` is not a registered gymnasium id."""
    import gymnasium as gym

    _ensure_registered(env_id)
    if env_id in gym.registry:
        return
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise EnvConfigError(f"{env_id!r} is not a registered gymnasium environment{hint}")


@dataclass
class GymEnvFactory:
    """Builds any registered gymnasium env by id.

    Examples:
        >>> env = GymEnvFactory("CartPole-v1")()
        >>> env.observation_space.shape
        (4,)
    """

    id: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> Any:
        import gymnasium as gym

        _ensure_registered(self.id)
        return gym.make(self.id, **dict(self.kwargs))


@dataclass
class AtariEnvFactory:
    """ALE env with the standard DQN/PPO preprocessing, uint8 frame stacks.

    The ALE env runs at frameskip 1 and gymnasium's ``AtariPreprocessing``
    does the skipping (max-pooling the last two frames), the noop starts,
    the 84x84 grey resize, then ``FrameStackObservation`` stacks 4 frames:
    observations are ``uint8[frame_stack, screen_size, screen_size]``.

    The ALE env itself is made with ``obs_type="grayscale"`` (a user's
    ``kwargs`` win): the preprocessing reads the screen from the emulator,
    so the observation the inner env builds on each skipped frame is thrown
    away, and an RGB one is a 100 KB copy where a grey one is 33 KB (Pong:
    393 against 429-503 us per step, the same observations). With
    ``direct`` (the default) the frame skip acts on the emulator itself
    instead of stepping the wrapped env once per frame
    (:class:`~components.atari.DirectAtariPreprocessing`: the same frames,
    rewards and ends, 305-330 against 366-434 us per Pong step); ``direct=False`` is
    gymnasium's ``AtariPreprocessing`` as it is.
    """

    id: str = "ALE/Pong-v5"
    frame_skip: int = 4
    noop_max: int = 30
    screen_size: int = 84
    frame_stack: int = 4
    terminal_on_life_loss: bool = False
    repeat_action_probability: float = 0.25
    kwargs: dict[str, Any] = field(default_factory=dict)
    direct: bool = True

    def __call__(self) -> Any:
        import gymnasium as gym
        from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

        from components.atari import DirectAtariPreprocessing

        _ensure_registered(self.id)
        kwargs = {"obs_type": "grayscale", **dict(self.kwargs)}
        env = gym.make(
            self.id,
            frameskip=1,
            repeat_action_probability=self.repeat_action_probability,
            **kwargs,
        )
        preprocessing = DirectAtariPreprocessing if self.direct else AtariPreprocessing
        env = preprocessing(
            env,
            noop_max=self.noop_max,
            frame_skip=self.frame_skip,
            screen_size=self.screen_size,
            terminal_on_life_loss=self.terminal_on_life_loss,
            grayscale_obs=True,
            scale_obs=False,
        )
        return FrameStackObservation(env, self.frame_stack)


def probe_env_spec(factory: Any) -> EnvSpec:
    """Build one env, read its spec, close it."""
    env = factory()
    try:
        return EnvSpec.from_env(env)
    finally:
        env.close()
