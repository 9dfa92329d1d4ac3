"""python -m pipeline.bench.replay alternates contenders, reports medians and writes its JSON."""

from __future__ import annotations

import json

import numpy as np

from pipeline.bench.replay import atari_stream, format_report, main


def test_the_synthetic_atari_stream_shares_frames_like_a_frame_stacking_wrapper() -> None:
    stream = atari_stream(64, num_envs=4, seed=0)
    obs, nxt = stream["observation"].numpy(), stream["next", "observation"].numpy()
    assert np.array_equal(nxt[:, :-1], obs[:, 1:])  # next = observation shifted by one frame
    same_env_next = stream["env_index"].numpy()[4:] == stream["env_index"].numpy()[:-4]
    continues = ~stream["next", "done"].numpy()[:-4] & same_env_next
    assert np.array_equal(obs[4:][continues], nxt[:-4][continues])  # and is the env's next observation


def test_a_small_replay_benchmark_alternates_contenders_and_writes_a_report(tmp_path, capsys) -> None:
    report = main(["--capacity", "2048", "--atari-capacity", "512", "--repeats", "2", "--sample-batches", "4",
                   "--impls", "ours", "--storages", "memory", "disk", "--scratch", str(tmp_path),
                   "--out", str(tmp_path / "out")])
    order = [(t["workload"], t["storage"], t["sampler"]) for t in report["trials"]]
    assert order[8:] == order[:8][::-1], "the second repeat runs in reverse order"
    assert all(t["ok"] for t in report["trials"]), report["trials"]
    entry = report["summary"]["ours/atari/disk/prioritized"]
    assert entry["runs"] == 2 and entry["extend"] > 0 and entry["sample"] > 0 and entry["update"] > 0
    assert entry["frames_per_transition"] < 1.1
    saved = json.loads(next((tmp_path / "out").glob("replay_*.json")).read_text())
    assert saved["summary"].keys() == report["summary"].keys()
    table = format_report(report)
    assert "| atari | disk | prioritized |" in table and "7.1x ours" in table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "disk trials clean up their scratch dirs"
