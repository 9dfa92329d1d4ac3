"""Dict/Tuple observations and action masks: packing, the env block, models, and whole runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from components.action_masks import with_masks
from components.collector.env_block import EnvBlock
from components.envs import EnvConfigError, EnvSpec
from components.models import ActorCritic, ModelSpec, QNetwork
from components.obs_tree import leaf_tensors, observation_tree, pack, tree_leaves, unpack
from tests.conftest import run_pipeline
from tests.fakes import TreeEnv, TreeEnvFactory, nest_packed, tree_consistent
from tests.test_spaces import PLACEMENTS, collect


def _spec(kind: str = "dict", mask: str | None = None) -> tuple[object, EnvSpec]:
    factory = with_masks(TreeEnvFactory(kind, mask), "action_mask")
    return factory, EnvSpec.from_env(factory())


def test_leaves_are_packed_aligned_and_read_back_bit_for_bit() -> None:
    env = TreeEnv("dict")
    leaves, tuples = tree_leaves(env.observation_space)
    assert [leaf.name for leaf in leaves] == ["flags", "frame", "goal", "state"]
    assert all(leaf.offset % 8 == 0 for leaf in leaves) and tuples == ()
    obs, _ = env.reset(seed=3)
    row = pack(leaves, obs)
    back = unpack(leaves, row)
    assert back["state"].dtype == np.float64 and back["state"].tolist() == obs["state"].tolist()
    assert back["frame"].tobytes() == obs["frame"].tobytes() and int(back["goal"]) == obs["goal"]
    tensors = leaf_tensors(leaves, torch.from_numpy(np.stack([row, row])))
    assert tensors[3].dtype == torch.float64 and tensors[3].shape == (2, 2)
    tree = observation_tree(leaves, torch.from_numpy(row[None]))
    assert tree["frame"].shape == (1, 2, 3, 3) and tree["goal"].dtype == torch.int64


def test_a_tuple_tree_rebuilds_its_space() -> None:
    env = TreeEnv("tuple")
    spec = EnvSpec.from_env(env)
    assert spec.is_tree and [leaf.name for leaf in spec.obs_leaves] == ["0", "1", "2/cells"]
    assert spec.spaces()[0] == env.observation_space


def test_a_space_it_cannot_carry_is_one_line() -> None:
    import gymnasium as gym

    class TextEnv(TreeEnv):
        def __init__(self) -> None:
            super().__init__()
            self.observation_space = gym.spaces.Dict({"a": gym.spaces.Text(8), "b": gym.spaces.Discrete(2)})

    with pytest.raises(EnvConfigError, match=r"Text\(.*at 'a' is not supported.*Dict/Tuple"):
        EnvSpec.from_env(TextEnv())


@pytest.mark.parametrize("kind,mask", [("dict", None), ("dict", "obs"), ("dict", "info"), ("tuple", None)])
def test_the_env_block_writes_every_leaf_and_models_act_within_the_mask(kind: str, mask: str | None) -> None:
    factory, spec = _spec(kind, mask)
    assert (spec.action_mask is not None) == (mask is not None)
    block = EnvBlock(factory, [0, 1, 2], [1, 2, 3])
    obs = np.zeros((3, *spec.obs_shape), np.uint8)
    block.reset(obs)
    rows = block.empty_rows()
    for model in (ActorCritic(spec, hidden=(8,)), QNetwork(spec, hidden=(8,))):
        for _ in range(20):  # a masked action would raise in the env
            actions = model.act({"observation": torch.from_numpy(obs)}, torch.zeros(3, dtype=torch.int8))["action"]
            block.step(actions.numpy(), rows, obs)
            if kind == "dict":
                assert tree_consistent(unpack(spec.obs_leaves, rows["next.observation"])).all()
    assert rows["next.episode_length"].max() <= 8
    block.close()


def test_masked_log_probs_and_entropy_ignore_forbidden_actions() -> None:
    _, spec = _spec("dict", "obs")
    model = ActorCritic(spec, hidden=(8,))
    env = TreeEnv("dict", "obs")
    obs = torch.from_numpy(pack(spec.obs_leaves, env.reset(seed=0)[0])[None])
    allowed = np.flatnonzero(env._allowed)
    log_prob, entropy, _ = model.evaluate(obs.repeat(2, 1), torch.tensor(allowed))
    assert torch.isfinite(entropy).all() and float(entropy[0]) <= np.log(2) + 1e-5
    assert abs(float(log_prob.exp().sum()) - 1.0) < 1e-5


def test_an_empty_mask_is_one_line_naming_the_env_and_step() -> None:
    factory = with_masks(TreeEnvFactory("dict", "obs", empty_mask_at=2), "action_mask")
    spec = EnvSpec.from_env(factory())
    block = EnvBlock(factory, [4], [0])
    obs = np.zeros((1, *spec.obs_shape), np.uint8)
    block.reset(obs)
    rows = block.empty_rows()
    model = ActorCritic(spec, hidden=(8,))
    with pytest.raises(ValueError, match=r"env 4 broke its spec after its step 2: its action mask 'action_mask' allows no"):
        for _ in range(3):
            block.step(model.act({"observation": torch.from_numpy(obs)})["action"].numpy(), rows, obs)
    block.close()


def test_a_leaf_off_its_space_is_named() -> None:
    class BadLeaf(TreeEnv):
        def _obs(self):  # noqa: ANN202
            obs = super()._obs()
            return {**obs, "state": np.zeros(5)} if self._t == 1 else obs

    block = EnvBlock(BadLeaf, [0], [0])
    obs = np.zeros((1, *block.spec.obs_shape), np.uint8)
    block.reset(obs)
    with pytest.raises(ValueError, match=r"env 0 broke its spec at its step 1: its observation leaf 'state' "):
        block.step(np.zeros(1, np.int64), block.empty_rows(), obs)
    block.close()


def test_replay_keeps_every_leaf_as_its_own_key(tmp_path: Path) -> None:
    from tensordict import TensorDict

    from components.replay.buffer import ReplayBuffer
    from components.replay.storage import TensorStorage

    factory, spec = _spec("dict")
    block = EnvBlock(factory, [0, 1], [5, 6])
    obs = np.zeros((2, *spec.obs_shape), np.uint8)
    block.reset(obs)
    rows = block.empty_rows()
    for storage in ("memory", "disk"):
        path = tmp_path / "replay" if storage == "disk" else None
        buffer = ReplayBuffer(TensorStorage(64, path=path))
        for _ in range(10):
            acted = obs.copy()
            block.step(np.zeros(2, np.int64), rows, obs)
            batch = TensorDict({"observation": torch.from_numpy(acted), "action": torch.zeros(2, dtype=torch.int64),
                                "next": TensorDict({k.split(".", 1)[1]: torch.from_numpy(v.copy())
                                                    for k, v in rows.items()}, batch_size=[2])}, batch_size=[2])
            buffer.extend(nest_packed(batch, spec.obs_leaves))
        sample = buffer.sample(16)
        for key in ("observation", ("next", "observation")):
            assert tree_consistent({leaf.name: sample[key][leaf.key].numpy() for leaf in spec.obs_leaves}).all()
            assert sample[key]["state"].dtype == torch.float64 and sample[key]["goal"].dtype == torch.int64
        if storage == "disk":  # one file per leaf
            assert (tmp_path / "replay" / "next" / "observation" / "flags.memmap").exists()
    block.close()


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_batches_carry_every_leaf_under_its_own_key_and_models_read_them_by_name(placement: str) -> None:
    """A model that reads ``obs["goal"]`` acts in the server (or inline) and its batches hold nested leaves."""
    from tensordict import TensorDictBase

    factory = with_masks(TreeEnvFactory("dict", "obs"), "action_mask")
    spec = EnvSpec.from_env(factory())
    batches = collect(factory, ModelSpec("tests.fakes.TreeReader", {"width": 8}), PLACEMENTS[placement], seed=3)
    for batch in batches:
        for key in ("observation", ("next", "observation")):
            tree = batch[key]
            assert isinstance(tree, TensorDictBase), key
            assert sorted(tree.keys()) == sorted(leaf.name for leaf in spec.obs_leaves)
            for leaf in spec.obs_leaves:
                assert tuple(tree[leaf.key].shape[1:]) == leaf.shape and str(tree[leaf.key].dtype).endswith(leaf.dtype)
            assert tree_consistent({leaf.name: tree[leaf.key].numpy() for leaf in spec.obs_leaves}).all(), key
    model = ModelSpec("tests.fakes.TreeReader", {"width": 8}).build(spec)
    log_prob, _, value = model.evaluate(batches[0]["observation"], batches[0]["action"])  # as the trainer calls it
    assert log_prob.shape == value.shape == (32,)


def _metrics(run_root: Path) -> list[dict]:
    path = next(run_root.rglob("metrics.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# (unmasked, the task takes 3x the frames: the Dict itself is what both runs read, and the collection tests above)
@pytest.mark.parametrize("workers,server,mask", [("process", "process", "obs"), ("thread", "inline", "info")])
def test_ppo_solves_dict_and_masked_tasks_through_the_pipeline(tmp_path: Path, workers: str, server: str,
                                                               mask: str) -> None:
    args = ["env.factory._target_=tests.fakes.TreeEnvFactory", "~env.factory.id", f"workers={workers}",
            f"server={server}", "trainer.total_frames=60000", "trainer.target_return=7.5", "env.num_envs=4",
            f"hydra.run.dir={tmp_path}/run"]
    args.append(f"+env.factory.mask={mask}")
    proc = run_pipeline(args, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "target_return:" in proc.stdout + proc.stderr
    where = {"obs": "masks     the observation's 'action_mask' leaf", "info": "masks     info['action_mask'] of"}
    assert where[mask] in proc.stdout, proc.stdout[-2000:]
    rows = _metrics(tmp_path / "run")
    assert max(r.get("episode/return_mean", 0) for r in rows) >= 7.5


def test_dqn_trains_with_masks(tmp_path: Path) -> None:
    proc = run_pipeline(["env.factory._target_=tests.fakes.TreeEnvFactory", "~env.factory.id", "+env.factory.mask=obs",
                         "trainer=dqn", "replay=uniform", "trainer.total_frames=3000", "trainer.target_return=null",
                         "trainer.learning_starts=500", f"hydra.run.dir={tmp_path}/run"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint.pt").exists()


def test_every_built_in_model_reads_the_nested_observation_as_it_reads_packed_rows() -> None:
    """SAC's actor and critics, the recurrent actor-critic and the Q-network: same outputs from either form."""
    import gymnasium as gym

    from components.obs_tree import model_observation
    from components.recurrent import RecurrentActorCritic, zero_state
    from components.sac_models import SquashedGaussianActor, TwinQ

    class Reach:
        observation_space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32), "goal": gym.spaces.Discrete(3)})
        action_space = gym.spaces.Box(-1, 1, (2,), np.float32)

    box = EnvSpec.from_env(Reach())
    _, discrete = _spec("dict", "obs")
    rows = np.stack([pack(box.obs_leaves, {"pos": np.float32([0.5, -0.25]) * k, "goal": k % 3}) for k in range(4)])
    packed = torch.from_numpy(rows)
    tree = model_observation(box.obs_leaves, packed)
    torch.manual_seed(0)
    actor, critic = SquashedGaussianActor(box, hidden=(8,)), TwinQ(box, hidden=(8,))
    action = torch.zeros(4, 2)
    assert torch.equal(actor(tree)[0], actor(packed)[0]) and torch.equal(critic(tree, action), critic(packed, action))
    factory, _ = _spec("dict", "obs")
    env = factory()
    rows = np.stack([pack(discrete.obs_leaves, env.reset(seed=k)[0]) for k in range(4)])
    packed = torch.from_numpy(rows)
    tree = model_observation(discrete.obs_leaves, packed)
    recurrent = RecurrentActorCritic(discrete, hidden=(8,), rnn="gru", rnn_hidden=4)
    state = zero_state(recurrent, 4)
    first = torch.ones(4, dtype=torch.bool)
    greedy = torch.ones(4, dtype=torch.int8)
    out = recurrent.act({"observation": tree, **state, "is_first": first}, greedy)
    assert torch.equal(out["action"], recurrent.act({"observation": packed, **state, "is_first": first}, greedy)["action"])
    allowed = tree["action_mask"].bool()
    assert allowed[torch.arange(4), out["action"]].all()
    q = QNetwork(discrete, hidden=(8,))
    assert torch.equal(q(tree), q(packed))
