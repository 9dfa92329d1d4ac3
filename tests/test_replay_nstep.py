"""n-step returns: each transition emitted once, with the window a hand computation gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from components.replay.nstep import NStepReturns


def transitions(env: list[int], step: list[int], reward: list[float], terminated: list[bool],
                truncated: list[bool] | None = None) -> TensorDict:
    n = len(env)
    truncated = truncated or [False] * n
    term, trunc = torch.tensor(terminated), torch.tensor(truncated)
    env_t, step_t = torch.tensor(env), torch.tensor(step)
    code = (env_t * 1000 + step_t).float()  # observation of (env, step) = its code; next = code + 0.5
    return TensorDict({
        "observation": code.unsqueeze(-1).expand(n, 3).clone(),
        "action": step_t % 2,
        "policy_version": step_t // 4,
        "env_index": env_t,
        "env_step": step_t,
        "next": {"observation": (code + 0.5).unsqueeze(-1).expand(n, 3).clone(), "reward": torch.tensor(reward),
                 "terminated": term, "truncated": trunc, "done": term | trunc},
    }, [n])


def reference(stream: TensorDict, n: int, gamma: float) -> dict[tuple[int, int], tuple[float, int, int]]:
    """(env, step) -> (return, m, step of the last transition), by the definition, for complete windows."""
    out = {}
    for e in stream["env_index"].unique().tolist():
        rows = stream[stream["env_index"] == e]
        rows = rows[rows["env_step"].argsort()]
        r, done, steps = rows["next", "reward"].tolist(), rows["next", "done"].tolist(), rows["env_step"].tolist()
        for i in range(len(steps)):
            total, m = 0.0, 0
            for k in range(n):
                if i + k >= len(steps):
                    break
                total += gamma**k * r[i + k]
                m += 1
                if done[i + k]:
                    break
            if m == n or done[i + m - 1]:
                out[(e, steps[i])] = (total, m, steps[i + m - 1])
    return out


def test_rewards_are_discounted_and_the_window_stops_at_an_episode_end() -> None:
    # env 0: steps 0..5, terminated at step 2; env 1: steps 0..3, truncated at step 1.
    batch = transitions(
        env=[0, 1, 0, 1, 0, 1, 0, 1, 0, 0], step=[0, 0, 1, 1, 2, 2, 3, 3, 4, 5],
        reward=[1.0, 10.0, 2.0, 20.0, 3.0, 30.0, 4.0, 40.0, 5.0, 6.0],
        terminated=[False, False, False, False, True, False, False, False, False, False],
        truncated=[False, False, False, True, False, False, False, False, False, False],
    )
    out = NStepReturns(n=3, gamma=0.5)(batch)
    got = {(e, s): (r, m, t, tr, nxt)
           for e, s, r, m, t, tr, nxt in zip(out["env_index"].tolist(), out["env_step"].tolist(),
                                             out["next", "reward"].tolist(), out["next", "n_steps"].tolist(),
                                             out["next", "terminated"].tolist(), out["next", "truncated"].tolist(),
                                             out["next", "observation"][:, 0].tolist())}
    assert got == {
        (0, 0): (1 + 0.5 * 2 + 0.25 * 3, 3, True, False, 2.5),   # ends on the terminal step
        (0, 1): (2 + 0.5 * 3, 2, True, False, 2.5),
        (0, 2): (3.0, 1, True, False, 2.5),
        (0, 3): (4 + 0.5 * 5 + 0.25 * 6, 3, False, False, 5.5),  # a full window in the next episode
        (1, 0): (10 + 0.5 * 20, 2, False, True, 1001.5),         # truncation: done, not terminated
        (1, 1): (20.0, 1, False, True, 1001.5),
    }
    # Observations, actions and versions stay those of the first step of the window.
    assert out["observation"][:, 0].tolist() == [e * 1000 + s for e, s in zip(out["env_index"].tolist(),
                                                                               out["env_step"].tolist())]
    assert out["policy_version"].tolist() == [s // 4 for s in out["env_step"].tolist()]


def test_incomplete_windows_are_carried_to_later_calls_and_emitted_once() -> None:
    nstep = NStepReturns(n=3, gamma=0.9)
    first = nstep(transitions([0, 0], [0, 1], [1.0, 2.0], [False, False]))
    assert first.batch_size[0] == 0 and nstep.pending == 2
    second = nstep(transitions([0], [2], [3.0], [False]))
    assert second["env_step"].tolist() == [0] and second["next", "reward"].item() == pytest.approx(1 + 1.8 + 2.43)
    third = nstep(transitions([0, 0], [3, 4], [4.0, 5.0], [True, False]))
    assert third["env_step"].tolist() == [1, 2, 3] and third["next", "n_steps"].tolist() == [3, 2, 1]
    assert nstep.pending == 1


@pytest.mark.parametrize("n", [2, 3, 5])
def test_random_interleaved_streams_match_the_definition(n: int) -> None:
    rng = np.random.default_rng(n)
    envs, steps = 6, 40
    env = np.tile(np.arange(envs), steps)
    step = np.repeat(np.arange(steps), envs)
    stream = transitions(env.tolist(), step.tolist(), rng.normal(size=env.size).tolist(),
                         (rng.random(env.size) < 0.1).tolist(), (rng.random(env.size) < 0.05).tolist())
    nstep, outs, start = NStepReturns(n=n, gamma=0.97), [], 0
    while start < env.size:  # batches of random sizes: windows straddle them
        size = int(rng.integers(1, 30))
        outs.append(nstep(stream[start : start + size]))
        start += size
    out = torch.cat(outs)
    want = reference(stream, n, 0.97)
    keys = list(zip(out["env_index"].tolist(), out["env_step"].tolist()))
    assert len(keys) == len(set(keys)) == len(want)
    for i, key in enumerate(keys):
        total, m, last = want[key]
        assert out["next", "reward"][i].item() == pytest.approx(total, rel=1e-5, abs=1e-5)
        assert out["next", "n_steps"][i].item() == m
        assert out["next", "observation"][i, 0].item() == key[0] * 1000 + last + 0.5
    assert nstep.pending == env.size - len(want)


def test_n_equal_one_passes_batches_through_unchanged() -> None:
    batch = transitions([0, 1, 0], [0, 0, 1], [1.0, 2.0, 3.0], [False, True, False])
    out = NStepReturns(n=1, gamma=0.99)(batch)
    assert (out.exclude(("next", "n_steps")) == batch).all()
    assert out["next", "n_steps"].tolist() == [1, 1, 1] and out["next", "n_steps"].dtype == torch.int64
    assert ("next", "n_steps") not in batch.keys(include_nested=True)


def test_state_dict_restores_the_carried_transitions() -> None:
    stream = transitions([0] * 6, list(range(6)), [1.0, 2, 3, 4, 5, 6], [False] * 6)
    a = NStepReturns(n=4, gamma=0.5)
    a(stream[:3])
    b = NStepReturns(n=4, gamma=0.5)
    b.load_state_dict(a.state_dict())
    assert b.pending == 3
    assert (b(stream[3:]) == a(stream[3:])).all()


def test_a_gap_in_env_steps_cuts_the_window_and_a_repeated_step_is_an_error() -> None:
    nstep = NStepReturns(n=3, gamma=0.9)
    assert nstep(transitions([0, 0], [0, 1], [1.0, 1.0], [False, False])).batch_size[0] == 0
    out = nstep(transitions([0, 0, 0], [5, 6, 7], [1.0, 1.0, 1.0], [False, False, False]))
    # steps 0 and 1 end at the gap (a restarted worker): 2 and 1 steps, never reaching into step 5
    assert out["env_step"].tolist()[:2] == [0, 1] and out["next", "n_steps"].tolist()[:2] == [2, 1]
    assert out["next", "reward"].tolist()[:2] == pytest.approx([1.9, 1.0])
    with pytest.raises(ValueError, match="env 0: env_step 7 arrived twice"):
        nstep(transitions([0], [7], [1.0], [False]))


def test_cut_closes_the_open_windows_as_truncations_and_new_envs_start_clean():
    nstep = NStepReturns(n=3, gamma=0.5)
    out = nstep(transitions([0, 0, 0, 1, 1], [250, 251, 252, 40, 41], [1.0, 2.0, 4.0, 8.0, 16.0], [False] * 5))
    assert {(int(e), int(s)) for e, s in zip(out["env_index"], out["env_step"])} == {(0, 250)}
    closed = nstep.cut()
    got = {(int(e), int(s)): (float(r), int(m), float(o[0]))
           for e, s, r, m, o in zip(closed["env_index"], closed["env_step"], closed["next", "reward"],
                                    closed["next", "n_steps"], closed["next", "observation"])}
    # each window ends at its env's last step, bootstrapping from that step's next observation
    assert got == {(0, 251): (2.0 + 0.5 * 4.0, 2, 252.5), (0, 252): (4.0, 1, 252.5),
                   (1, 40): (8.0 + 0.5 * 16.0, 2, 1041.5), (1, 41): (16.0, 1, 1041.5)}
    assert not closed["next", "terminated"].any()
    assert nstep.pending == 0 and nstep.cut() is None
    # the replacement envs count their steps from 0 again: no "arrived twice", no window across the cut
    again = nstep(transitions([0, 0, 0, 0], [0, 1, 2, 3], [1.0, 1.0, 1.0, 1.0], [False] * 4))
    assert again["env_step"].tolist() == [0, 1] and again["next", "n_steps"].tolist() == [3, 3]
