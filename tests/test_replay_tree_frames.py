"""Frame dedup for the image leaves of Dict observations: every leaf comes back bit for bit from about a frame a step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from components.envs import EnvSpec
from components.obs_tree import frame_leaves, pack, tree_leaves
from components.replay.buffer import ReplayBuffer
from components.replay.nstep import NStepReturns
from components.replay.frames import FrameStackStorage, tree_frame_keys
from pipeline.plan import Machine, resolve_plan
from pipeline.plan.render import plan_lines
from pipeline.plan.validate import ConfigError
from pipeline.runner.budgets import SMALL_FIELDS_BYTES, transition_bytes
from tests.conftest import compose, run_pipeline
from tests.fakes import PixelsDictEnv, TreeEnv, nest_packed, pixels_consistent
from tests.test_replay_frames import assert_rebuilt_exactly, batches, stream_tensordict

CPU_MACHINE = Machine(cpus=2, cuda=False)


def dict_stream(num_envs: int, steps: int, *, extra_image: bool = False) -> tuple[TensorDict, tuple]:
    """Transitions of ``num_envs`` :class:`PixelsDictEnv` interleaved time-major, observations nested as batches are."""
    envs = [PixelsDictEnv(e, 4, extra_image) for e in range(num_envs)]
    leaves, _ = tree_leaves(envs[0].observation_space)
    obs = [env.reset()[0] for env in envs]
    out: dict[str, list] = {k: [] for k in ("obs", "next", "reward", "term", "trunc", "env", "step")}
    for t in range(steps):
        for e, env in enumerate(envs):
            nxt, reward, term, trunc, _ = env.step(t % 2)
            for key, value in zip(out, (pack(leaves, obs[e]), pack(leaves, nxt), reward, term, trunc, e, t)):
                out[key].append(value)
            obs[e] = env.reset()[0] if term or trunc else nxt
    return nest_packed(stream_tensordict(out), leaves), leaves


def assert_consistent(got: TensorDict, key: str | tuple = "observation") -> None:
    """Every observation read back holds the frames its own clock leaf names (checks the frames, not the stream)."""
    obs = got[key]
    assert pixels_consistent(obs["pixels"].numpy(), obs["clock"].numpy()).all()


def storage(leaves: tuple, capacity: int, **kwargs) -> FrameStackStorage:
    return FrameStackStorage(capacity, frame_keys=tree_frame_keys(leaves), **kwargs)


@pytest.mark.parametrize("where", ["memory", "disk"])
@pytest.mark.parametrize("batch_size", [1, 7, 300])
def test_every_leaf_comes_back_bit_for_bit_from_about_a_frame_a_transition(tmp_path: Path, where: str,
                                                                            batch_size: int) -> None:
    stream, leaves = dict_stream(num_envs=5, steps=60)
    assert stream["next", "done"].sum() > 20  # many episode starts inside the stacks
    assert tree_frame_keys(leaves) == [("observation", "pixels"), ("next", "observation", "pixels")]
    s = storage(leaves, 1000, path=tmp_path / "rb" if where == "disk" else None)
    for batch in batches(stream, batch_size):
        s.extend(batch)
    n = stream.batch_size[0]
    got = s.get(torch.arange(n))
    assert_rebuilt_exactly(got, stream)
    assert_consistent(got)
    # one new frame per step plus each episode's first: far below the 8 a transition holds
    episodes = int(stream["next", "done"].sum()) + 5
    assert s.frames_written == n + episodes
    whole = 2 * (4 * 36 * 36 + 8)  # both observations stored as they are
    assert s.nbytes < 0.25 * s.capacity * whole
    if where == "disk":  # the clock leaves are files of their own beside the frame pool
        assert (tmp_path / "rb" / "transitions" / "observation" / "clock.memmap").exists()


def test_n_step_transitions_and_prioritised_sampling_read_exact_rows() -> None:
    stream, leaves = dict_stream(num_envs=3, steps=80)
    buffer = ReplayBuffer(storage(leaves, 400), sampler="prioritized", seed=0)
    nstep = NStepReturns(3, 0.99)
    for batch in batches(stream, 48):
        buffer.extend(nstep(batch))
    sample = buffer.sample(256)
    assert_consistent(sample)
    assert_consistent(sample, ("next", "observation"))
    assert bool((sample["next", "n_steps"] > 1).any())


def test_a_disk_storage_reopens_from_its_state(tmp_path: Path) -> None:
    stream, leaves = dict_stream(num_envs=4, steps=30)
    s = storage(leaves, 200, path=tmp_path / "rb")
    s.extend(stream)
    state = s.state_dict()
    assert ["observation", "clock"] in [entry[0] for entry in state["rows"]["layout"]]  # names a resume checks
    reopened = storage(leaves, 200, path=tmp_path / "rb")
    reopened.load_state_dict(state)
    assert_rebuilt_exactly(reopened.get(torch.arange(len(reopened))), stream)


def test_an_image_leaf_of_another_shape_is_stored_whole_and_still_exact() -> None:
    stream, leaves = dict_stream(num_envs=2, steps=40, extra_image=True)
    assert [leaf.name for leaf in frame_leaves(leaves)] == ["pixels"]  # "map" (1x40x40) is not the largest's shape
    s = storage(leaves, 100)
    s.extend(stream)
    assert_rebuilt_exactly(s.get(torch.arange(len(s))), stream)


def test_a_tree_without_an_image_leaf_has_no_frame_keys() -> None:
    tree, _ = tree_leaves(TreeEnv("dict").observation_space)  # its frame leaf is 2x3x3: not an image
    assert frame_leaves(tree) == () and tree_frame_keys(tree) == []


def test_the_plan_dedups_a_dict_image_leaf_and_says_so() -> None:
    pixels = EnvSpec.from_env(PixelsDictEnv())
    plan = resolve_plan(compose("trainer=dqn", "replay=uniform"), CPU_MACHINE, pixels)
    dedup = plan.choice("replay").facts["dedup"]
    assert plan.frame_dedup is True and (dedup.code, dedup.facts["leaves"]) == ("auto.on", ["pixels"])
    assert "frame dedup auto -> on: image leaf 'pixels' (4x36x36 uint8)" in "\n".join(plan_lines(plan))
    # the memory/disk budget counts about a frame of pixels a transition, and both clocks
    assert transition_bytes(pixels, frame_dedup=True) == int(1.125 * 36 * 36) + 2 * 8 + SMALL_FIELDS_BYTES
    assert transition_bytes(pixels) == 2 * (8 + 4 * 36 * 36) + SMALL_FIELDS_BYTES
    tree = EnvSpec.from_env(TreeEnv("dict"))
    plan = resolve_plan(compose("trainer=dqn", "replay=uniform"), CPU_MACHINE, tree)
    assert plan.frame_dedup is False
    assert "frame dedup auto -> off: the Dict/Tuple observation has no uint8 image leaf" in "\n".join(plan_lines(plan))
    with pytest.raises(ConfigError, match=r"^replay.frame_dedup=True: the Dict/Tuple observation has no uint8 "):
        resolve_plan(compose("trainer=dqn", "replay=uniform", "replay.frame_dedup=true"), CPU_MACHINE, tree)


def test_dqn_on_a_dict_with_pixels_stores_frames_once_on_disk(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_pipeline(["env.factory._target_=tests.fakes.PixelsDictEnvFactory", "~env.factory.id", "trainer=dqn",
                         "replay=uniform", "replay.storage=disk", "replay.capacity=2000", "env.num_envs=4",
                         "trainer.total_frames=1200", "trainer.target_return=null", "trainer.learning_starts=300",
                         "checkpoint.frames=600", f"hydra.run.dir={run}"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "frame dedup auto -> on: image leaf 'pixels'" in proc.stdout, proc.stdout[-3000:]
    assert (run / "checkpoint.pt").exists()
    frames = run / "replay" / "frames.memmap"
    assert frames.stat().st_size == (2000 + 250 + 64 * 4) * 36 * 36  # the pool; rows hold no pixels
    stored = sum(p.stat().st_size for p in (run / "replay" / "transitions").rglob("*") if p.is_file())
    assert stored < 2000 * 2 * 4 * 36 * 36 / 20
    rows = [json.loads(line) for line in next(run.rglob("metrics.jsonl")).read_text().splitlines() if line.strip()]
    assert any("train/loss" in r for r in rows)


def test_a_dict_key_that_cannot_name_a_file_is_one_line_for_a_disk_replay_only() -> None:
    import gymnasium as gym

    class Spaced:
        observation_space = gym.spaces.Dict({"joint angles": gym.spaces.Box(-1, 1, (3,), np.float32)})
        action_space = gym.spaces.Discrete(2)

    spec = EnvSpec.from_env(Spaced())
    with pytest.raises(ConfigError, match=r"^replay.storage=disk: the observation's Dict key 'joint angles' cannot "
                                          r"name a file \(letters, digits, _, \. and - only\)"):
        resolve_plan(compose("trainer=dqn", "replay=uniform", "replay.storage=disk"), CPU_MACHINE, spec)
    assert resolve_plan(compose("trainer=dqn", "replay=uniform"), CPU_MACHINE, spec).frame_dedup is False
