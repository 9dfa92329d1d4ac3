"""Frame-stack storage: stacks come back exactly as stored, from about one stored frame per transition."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.wrappers import FrameStackObservation
from tensordict import TensorDict

from components.replay import frames as frames_module
from components.replay.buffer import ReplayBuffer
from components.replay.frames import FrameStackStorage, default_frame_capacity
from components.replay.nstep import NStepReturns
from tests.conftest import sample_while_writing


class DistinctFrames(gym.Env):
    """Every observation is a frame never seen before (env id and frame count in its first bytes, noise after).

    Episodes have random lengths and end by termination or truncation at random.
    """

    def __init__(self, env_id: int, shape: tuple[int, int], max_len: int, seed: int) -> None:
        self.observation_space = gym.spaces.Box(0, 255, shape, np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        self._env_id, self._shape, self._max_len = env_id, shape, max_len
        self._noise = np.random.default_rng(seed)
        self._count = 0

    def _frame(self) -> np.ndarray:
        self._count += 1
        frame = self._noise.integers(0, 256, self._shape, dtype=np.uint8)
        frame.flat[:4] = [self._env_id, self._count % 256, self._count // 256 % 256, self._count // 65536]
        return frame

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._t, self._len = 0, int(self._noise.integers(1, self._max_len + 1))
        self._truncate = bool(self._noise.random() < 0.5)
        return self._frame(), {}

    def step(self, action):
        self._t += 1
        end = self._t >= self._len
        return self._frame(), float(self._noise.normal()), end and not self._truncate, end and self._truncate, {}


def atari_stream(num_envs: int, steps: int, *, stack: int = 4, shape=(6, 6), max_len: int = 9,
                 padding: str = "reset", seed: int = 0) -> TensorDict:
    """Transitions of ``num_envs`` frame-stacked envs interleaved time-major, as the collector delivers them."""
    envs = [FrameStackObservation(DistinctFrames(e, shape, max_len, seed + e), stack, padding_type=padding)
            for e in range(num_envs)]
    obs = [env.reset(seed=seed + e)[0] for e, env in enumerate(envs)]
    out: dict[str, list] = {k: [] for k in ("obs", "next", "reward", "term", "trunc", "env", "step")}
    for t in range(steps):
        for e, env in enumerate(envs):
            nxt, reward, term, trunc, _ = env.step(0)
            for key, value in zip(out, (obs[e], nxt, reward, term, trunc, e, t)):
                out[key].append(value)
            obs[e] = env.reset()[0] if term or trunc else nxt
    return stream_tensordict(out)


def stream_tensordict(out: dict[str, list]) -> TensorDict:
    """Per-step lists of observations, successors, rewards, flags, env and step as the collector's batch."""
    n = len(out["env"])
    term, trunc = torch.tensor(out["term"]), torch.tensor(out["trunc"])
    return TensorDict({
        "observation": torch.from_numpy(np.stack(out["obs"])),
        "action": torch.zeros(n, dtype=torch.int64),
        "policy_version": torch.tensor(out["step"]) // 10,
        "env_index": torch.tensor(out["env"]),
        "env_step": torch.tensor(out["step"]),
        "next": {"observation": torch.from_numpy(np.stack(out["next"])), "reward": torch.tensor(out["reward"]),
                 "terminated": term, "truncated": trunc, "done": term | trunc},
    }, [n])


def batches(stream: TensorDict, size: int):
    for start in range(0, stream.batch_size[0], size):
        yield stream[start : start + size]


def by_transition(stream: TensorDict) -> dict[tuple[int, int], int]:
    return {(e, s): i for i, (e, s) in enumerate(zip(stream["env_index"].tolist(), stream["env_step"].tolist()))}


def assert_rebuilt_exactly(got: TensorDict, stream: TensorDict) -> None:
    """Each returned transition equals the one collected for its (env, step), every key included."""
    where = by_transition(stream)
    rows = torch.tensor([where[(e, s)] for e, s in zip(got["env_index"].tolist(), got["env_step"].tolist())])
    want = stream[rows]
    for key in want.keys(include_nested=True, leaves_only=True):
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("padding", ["reset", "zero"])
@pytest.mark.parametrize("batch_size", [1, 7, 300])  # 1: every match goes through the per-env tables
def test_stacks_are_rebuilt_exactly_across_episode_boundaries(padding: str, batch_size: int) -> None:
    stream = atari_stream(num_envs=5, steps=60, padding=padding, max_len=6)
    assert stream["next", "done"].sum() > 20  # many episode boundaries inside the stacks
    storage = FrameStackStorage(1000)
    for batch in batches(stream, batch_size):
        storage.extend(batch)
    got = storage.get(torch.arange(len(storage)))
    assert_rebuilt_exactly(got, stream)
    # Consecutive stacks share frames: about one new frame per transition, plus each episode's first ones.
    episodes = int(stream["next", "done"].sum()) + 5
    assert storage.frames_written <= len(storage) + episodes * (1 if padding == "reset" else 2)


def test_frames_survive_the_pool_wrapping_around_many_times() -> None:
    stream = atari_stream(num_envs=3, steps=200, max_len=12)
    storage = FrameStackStorage(50)  # 600 transitions through 50 slots and a 50 + 6 + 256 frame pool
    buffer = ReplayBuffer(storage, seed=0)
    for batch in batches(stream, 16):
        buffer.extend(batch)
    assert storage.frames_written > 2 * storage.frame_capacity
    assert storage.valid_mask(torch.arange(50)).all()
    assert_rebuilt_exactly(storage.get(torch.arange(50)), stream)
    assert_rebuilt_exactly(buffer.sample(200), stream)


def test_transitions_whose_frames_were_overwritten_are_never_sampled() -> None:
    stream = atari_stream(num_envs=4, steps=100, max_len=5)
    storage = FrameStackStorage(100, frame_capacity=60)  # deliberately too small a pool
    for sampler in ("uniform", "prioritized"):
        buffer = ReplayBuffer(storage, sampler=sampler, seed=1)
        for batch in batches(stream, 20):
            buffer.extend(batch)
        valid = storage.valid_mask(torch.arange(100))
        assert 0 < valid.sum() < 100
        with pytest.raises(IndexError, match="valid_mask"):
            storage.get(torch.nonzero(~valid)[:1, 0])
        for _ in range(5):
            got = buffer.sample(64)
            assert valid[got["index"]].all()
            assert_rebuilt_exactly(got, stream)
        assert buffer.stats()["rejected_invalid"] > 0
        storage = FrameStackStorage(100, frame_capacity=60)


def test_a_crc_collision_never_returns_a_wrong_frame(monkeypatch) -> None:
    monkeypatch.setattr(frames_module.zlib, "crc32", lambda data: 7)  # every frame collides
    stream = atari_stream(num_envs=2, steps=30)
    storage = FrameStackStorage(100)
    for batch in batches(stream, 9):
        storage.extend(batch)
    assert_rebuilt_exactly(storage.get(torch.arange(60)), stream)


def test_n_step_successors_share_frames_and_rebuild_exactly() -> None:
    stream = atari_stream(num_envs=4, steps=80, max_len=15)
    nstep = NStepReturns(n=3, gamma=0.9)
    storage = FrameStackStorage(1000)
    emitted = []
    for batch in batches(stream, 10):
        out = nstep(batch)
        storage.extend(out)
        emitted.append(out)
    expected = torch.cat(emitted)
    got = storage.get(torch.arange(len(storage)))
    assert len(storage) == expected.batch_size[0] > 250
    for key in expected.keys(include_nested=True, leaves_only=True):
        assert torch.equal(got[key], expected[key]), key
    # n-step observation windows still cost about one frame per transition.
    assert storage.frames_written < 1.3 * len(stream["env_index"])


def test_disk_frame_storage_reopens_from_a_state_dict(tmp_path) -> None:
    stream = atari_stream(num_envs=3, steps=40)
    storage = FrameStackStorage(64, path=tmp_path / "frames")
    for batch in list(batches(stream, 11))[:8]:
        storage.extend(batch)
    torch.save(storage.state_dict(), tmp_path / "state.pt")
    before = storage.get(torch.arange(len(storage)))
    written = storage.frames_written
    del storage
    reopened = FrameStackStorage(64, path=tmp_path / "frames")
    reopened.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert (reopened.get(torch.arange(len(reopened))) == before).all()
    for batch in list(batches(stream, 11))[8:]:
        reopened.extend(batch)
    assert_rebuilt_exactly(reopened.get(torch.arange(len(reopened))), stream)
    # The restored match tables keep deduplicating: about one new frame per new transition.
    assert reopened.frames_written - written <= 120 - 88 + 3 * 4 * 2


def test_memory_storage_state_dict_carries_the_frames() -> None:
    stream = atari_stream(num_envs=2, steps=20)
    storage = FrameStackStorage(30, frame_capacity=40)
    storage.extend(stream)
    copy = FrameStackStorage(30)
    copy.load_state_dict(storage.state_dict())
    assert copy.frame_capacity == 40
    assert (copy.get(torch.arange(30)) == storage.get(torch.arange(30))).all()


def test_a_million_pong_transitions_need_about_one_frame_each(tmp_path) -> None:
    storage = FrameStackStorage(1_000_000, path=tmp_path)  # sparse files: nothing is allocated up front
    storage.extend(atari_stream(num_envs=2, steps=8, shape=(84, 84)))
    frame = 84 * 84
    assert storage.frame_capacity == default_frame_capacity(1_000_000, 4) == 1_125_256
    assert storage.frame_bytes_per_transition == pytest.approx(1.125 * frame, rel=0.01)
    assert storage.naive_bytes_per_transition == 2 * 4 * frame
    assert storage.naive_bytes_per_transition / storage.frame_bytes_per_transition >= 7
    assert 7.0e9 < storage.frame_bytes < 8.0e9  # about 7 GB (7.4 GiB) of frames for 1M transitions


def test_batches_larger_than_the_capacity_keep_their_last_rows() -> None:
    stream = atari_stream(num_envs=2, steps=30)
    storage = FrameStackStorage(16)
    storage.extend(stream[:5])
    storage.extend(stream[5:])
    assert storage.cursor == 60 % 16
    got = storage.get(torch.arange(16))
    assert sorted(got["env_step"].tolist()) == sorted(stream["env_step"][-16:].tolist())
    assert_rebuilt_exactly(got, stream)


def test_sampling_while_a_writer_thread_extends_frame_stacks_returns_exact_stacks() -> None:
    stream = atari_stream(num_envs=4, steps=150, max_len=10)
    buffer = ReplayBuffer(FrameStackStorage(120), sampler="prioritized", seed=0)
    parts = list(batches(stream, 12))
    buffer.extend(parts[0])
    sample_while_writing(buffer, parts[1:], 32, lambda got: assert_rebuilt_exactly(got, stream))
