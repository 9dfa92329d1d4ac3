"""BPTT sequences: every row once, in order, never across an episode end, a step gap or another env."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from components.trainers.sequences import split_sequences, trajectory_starts


def _random_batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    env, step, done = [], [], []
    for e in range(int(rng.integers(1, 6))):
        s = int(rng.integers(0, 1000))
        for _ in range(int(rng.integers(1, 40))):
            if rng.random() < 0.05:
                s += int(rng.integers(2, 9))  # a gap: a replaced env's steps
            env.append(e), step.append(s), done.append(bool(rng.random() < 0.1))
            s += 1
    return np.array(env), np.array(step), np.array(done)


def _reference(env: np.ndarray, step: np.ndarray, done: np.ndarray, seq_len: int) -> list[list[int]]:
    """The sequences by the definition, one row at a time."""
    out: list[list[int]] = []
    for i in range(len(env)):
        new_trajectory = i == 0 or env[i] != env[i - 1] or step[i] != step[i - 1] + 1 or done[i - 1]
        if new_trajectory or len(out[-1]) == seq_len:
            out.append([])
        out[-1].append(i)
    return out


@pytest.mark.parametrize("seq_len", [1, 3, 8, 64])
def test_sequences_match_the_definition_on_random_batches(seq_len):
    rng = np.random.default_rng(seq_len)
    for _ in range(50):
        env, step, done = _random_batch(rng)
        seqs = split_sequences(env, step, done, seq_len)
        got = [[int(i) for i, m in zip(row, keep) if m] for row, keep in zip(seqs.index, seqs.mask)]
        assert got == _reference(env, step, done, seq_len)
        assert seqs.starts.tolist() == [s[0] for s in got]
        assert seqs.mask.sum() == len(env) and sorted(seqs.index[seqs.mask].tolist()) == list(range(len(env)))
        assert all(bool(m[: int(m.sum())].all()) for m in seqs.mask), "real places first, padding at the end"


def test_gathered_values_are_the_rows_values_with_zero_padding():
    env, step = np.array([0, 0, 0, 1, 1]), np.array([3, 4, 5, 9, 10])
    done = np.array([False, False, True, False, False])
    seqs = split_sequences(env, step, done, seq_len=2)
    advantages = torch.tensor([0.5, -1.25, 2.0, 3.0, 4.5], dtype=torch.float64)  # computed on the whole batch
    assert seqs.gather(advantages).tolist() == [[0.5, -1.25], [2.0, 0.0], [3.0, 4.5]]
    obs = torch.arange(10).reshape(5, 2)
    assert seqs.gather(obs)[1].tolist() == [[4, 5], [0, 0]]
    assert torch.equal(seqs.gather(advantages)[seqs.mask], advantages[seqs.index[seqs.mask]]), "bit for bit"


def test_unsorted_rows_and_a_bad_length_are_refused():
    with pytest.raises(ValueError, match="sorted by env, then by step"):
        split_sequences(np.array([0, 0]), np.array([2, 1]), np.array([False, False]), 4)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        split_sequences(np.array([0]), np.array([0]), np.array([False]), 0)
    assert trajectory_starts(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([True, False, False])).tolist() == \
        [True, True, True]
    empty = split_sequences(np.array([], np.int64), np.array([], np.int64), np.array([], bool), 4)
    assert empty.count == 0


def test_without_a_length_each_trajectory_of_the_batch_is_one_sequence():
    env = np.array([0, 0, 0, 0, 1, 1])
    step = np.array([3, 4, 5, 6, 0, 1])
    done = np.array([False, True, False, False, False, False])
    s = split_sequences(env, step, done, seq_len=None)
    assert s.index.tolist() == [[0, 1], [2, 3], [4, 5]] and s.mask.all()
    assert split_sequences(env[:1], step[:1], done[:1], None).index.tolist() == [[0]]
