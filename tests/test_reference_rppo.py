"""The recurrent reference runs on a no-velocity env and writes the rows the learning benchmark reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_recurrent_reference_runs_and_writes_rows_the_benchmark_reads(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pipeline.bench.reference_rppo", "--env-id", "CartPole-v1",
                           "--no-velocity", "1", "--total-frames", "4096", "--num-envs", "4", "--frames-per-batch",
                           "256", "--minibatches", "2", "--epochs", "2", "--eval-episodes", "2", "--critic-trunk", "1", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(isinstance(r.get("episode/return_mean"), (int, float)) for r in rows if "summary" not in r)
    summary = next(r["summary"] for r in rows if "summary" in r)
    assert isinstance(summary["wall_time_s"], float) and isinstance(summary["eval/return_mean"], float)


def test_the_reference_critic_trunk_has_its_own_state_and_a_sequence_equals_its_steps():
    import torch

    from pipeline.bench.reference_rppo import RecurrentAgent

    torch.manual_seed(0)
    agent = RecurrentAgent(2, 2, True, 8, "lstm", 16, 1, "tanh", critic_trunk=True)
    assert len(agent.initial_state(3)) == 4  # the actor's (h, c), then the critic's
    x = torch.randn(5 * 3, 2)
    done = torch.zeros(5, 3)
    done[2, 1] = 1.0  # env 1 starts a new episode at step 2: its state is zeroed there
    action, _, _, value, state = agent.act(x, agent.initial_state(3), done)
    stepped, values = agent.initial_state(3), []
    for t in range(5):
        _, _, _, v, stepped = agent.act(x[t * 3:(t + 1) * 3], stepped, done[t:t + 1], action[t * 3:(t + 1) * 3])
        values.append(v)
    assert torch.allclose(torch.cat(values), value, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(state, stepped))
    shared = RecurrentAgent(2, 2, True, 8, "lstm", 16, 1, "tanh")
    assert len(shared.initial_state(3)) == 2
    # the critic's trunk, not the actor's, feeds the value: changing it changes values, not actions' log-probs
    _, logp, _, v0, _ = agent.act(x, agent.initial_state(3), done, action)
    with torch.no_grad():
        agent.critic_trunk.encoder[0].weight.mul_(2.0)
    _, logp2, _, v1, _ = agent.act(x, agent.initial_state(3), done, action)
    assert torch.equal(logp, logp2) and not torch.allclose(v0, v1)
