"""Evaluation videos: rendering envs, the mp4 and GIF encoders, the evaluator's recordings, a run's videos in
every sink, and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from components.env_set import EnvSet, EnvSetEntry
from components.envs import GymEnvFactory, probe_env_spec
from components.models import ActorCritic
from components.partial_obs import NoVelocityEnvFactory
from components.video import VideoError, frame_of, gif_bytes, read_mp4, render_factory, write_mp4
from pipeline.plan.eval_settings import VideoSettings
from pipeline.runner.evaluation import Evaluator
from tests.conftest import run_pipeline
from tests.fakes import SlowEnvFactory


def test_an_mp4_decodes_to_its_frames_and_size_and_odd_sides_are_padded(tmp_path):
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 255, (33, 50, 3), dtype=np.uint8) for _ in range(17)]
    path = write_mp4(tmp_path / "videos" / "7.mp4", frames, fps=20)
    back = read_mp4(path)
    assert len(back) == 17 and back[0].shape == (34, 50, 3)  # one black row makes the height even for H.264
    assert not list((tmp_path / "videos").glob(".*"))  # written under a temporary name, renamed: nothing left over
    gif = gif_bytes(frames, fps=20, max_side=25)
    assert gif[:6] == b"GIF89a" and int.from_bytes(gif[6:8], "little") == 25


def test_no_frames_or_a_bad_path_is_a_video_error_and_leaves_no_file(tmp_path):
    with pytest.raises(VideoError, match="no frames"):
        write_mp4(tmp_path / "a.mp4", [], fps=10)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises((VideoError, OSError)):
        write_mp4(blocker / "b.mp4", [np.zeros((4, 4, 3), np.uint8)], fps=10)
    assert not (tmp_path / "a.mp4").exists()


def test_rendering_factories_render_rgb_frames_and_step_as_the_originals():
    for factory in (GymEnvFactory("CartPole-v1"), NoVelocityEnvFactory("CartPole-v1")):
        plain, rendering = factory(), render_factory(factory)()
        a, _ = plain.reset(seed=3)
        b, _ = rendering.reset(seed=3)
        for _ in range(5):
            a = plain.step(0)[0]
            b = rendering.step(0)[0]
        assert np.array_equal(a, b)
        assert frame_of(rendering).shape == (400, 600, 3)
        plain.close()
        rendering.close()
    env_set = render_factory(EnvSet([EnvSetEntry(GymEnvFactory("CartPole-v1"), 2, "a"),
                                     EnvSetEntry(GymEnvFactory("Acrobot-v1"), 1, "b")]))
    assert [e.factory.kwargs["render_mode"] for e in env_set.entries] == ["rgb_array", "rgb_array"]
    with pytest.raises(VideoError, match="cannot record videos of SlowEnvFactory envs"):
        render_factory(SlowEnvFactory(0.0))
    with pytest.raises(VideoError, match="CartPole-v1 does not render rgb_array frames"):
        env = GymEnvFactory("CartPole-v1")()
        env.reset(seed=0)
        frame_of(env)


def _recorder(tmp_path, every: int = 1, episodes: int = 2, max_steps: int = 600):
    from components.models import ModelSpec
    from pipeline.runner.video_recorder import VideoRecorder

    factory = GymEnvFactory("CartPole-v1")
    env_spec = probe_env_spec(factory)
    spec = ModelSpec("components.models.ActorCritic", {"hidden": [8]})
    recorder = VideoRecorder(factory, spec, env_spec, VideoSettings(every=every, episodes=episodes,
                                                                     max_steps=max_steps), 3, tmp_path / "videos")
    return factory, spec.build(env_spec), recorder


def test_videos_of_every_nth_evaluation_and_the_final_one_replay_the_evaluations_episodes(tmp_path):
    factory, model, recorder = _recorder(tmp_path, every=2)
    evaluator = Evaluator(factory, model, episodes=2, seed=5, recorder=recorder)
    made = []
    try:
        for frames in (100, 200, 300):
            assert evaluator.start(model.state_dict(), version=1, frames=frames, final=frames == 300)
            evaluator.wait(60)
            result = evaluator.poll()
            videos = evaluator.videos(wait=120)
            made.append((result, videos))
    finally:
        evaluator.close()
    assert [[f for _, f in v] for _, v in made] == [[100], [], [300]], "the 1st (every 2nd) and the final one"
    for result, videos in made:
        for path, _ in videos:  # both eval envs' episodes, each its reset frame and one per step
            assert len(read_mp4(path)) == int(2 * result["length_mean"]) + 2
    assert recorder._process is None, "closed with the evaluator"


def test_a_video_process_that_dies_is_one_warning_and_evaluation_goes_on(tmp_path, capsys):
    factory, model, recorder = _recorder(tmp_path)
    evaluator = Evaluator(factory, model, episodes=2, seed=5, recorder=recorder)
    try:
        assert evaluator.start(model.state_dict(), version=1, frames=100)
        recorder._process.kill()
        evaluator.wait(60)
        assert evaluator.poll()["episodes"] == 2
        deadline = __import__("time").monotonic() + 30
        while recorder.disabled is None and __import__("time").monotonic() < deadline:
            evaluator.videos()
        assert recorder.disabled is not None and "the video process died" in recorder.disabled
        assert not recorder.submit(model.state_dict(), [1, 2], 200)
        assert evaluator.start(model.state_dict(), version=2, frames=200)
        evaluator.wait(60)
        assert evaluator.poll()["policy_version"] == 2
    finally:
        evaluator.close()
    err = capsys.readouterr().err
    assert err.count("warning: evaluation videos stop: the video process died") == 1


@pytest.mark.slow
def test_a_cartpole_run_with_videos_leaves_an_mp4_a_tensorboard_image_and_a_wandb_video(tmp_path):
    run_dir = tmp_path / "run"
    result = run_pipeline(["eval=video", "eval.interval=1024", "eval.episodes=1", "eval.video_max_steps=300",
                           "trainer.total_frames=3072", "trainer.target_return=null", "logger.interval=0.2",
                           "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "XDG_RUNTIME_DIR" not in result.stderr
    assert "a video of 1 episode(s) at every evaluation and the final one" in result.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = rows[-1]["summary"]
    final = run_dir / "videos" / f"{int(summary['eval/frames'])}.mp4"
    assert final.is_file()
    frames = read_mp4(final)
    # one episode of eval/length_mean steps: its reset frame and one per step, capped at video_max_steps
    assert len(frames) == min(int(summary["eval/length_mean"]) + 1, 300)
    assert frames[0].shape == (400, 600, 3) and frames[0].std() > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"images": 0})
    events.Reload()
    images = events.Images("eval/video")
    assert images and images[-1].encoded_image_string[:6] == b"GIF89a" and images[-1].width == 300
    wandb_videos = list((run_dir / "wandb").glob("offline-run-*/files/media/videos/eval/video_*.mp4"))
    assert len(wandb_videos) == len(images) >= 2
    assert any(p.read_bytes() == final.read_bytes() for p in wandb_videos)


@pytest.mark.parametrize("args, message", [
    (["eval.video=true", "eval.episodes=2", "eval.video_episodes=3"],
     "eval.video_episodes=3: must be >= 1 and at most eval.episodes=2"),
    (["eval.interval=100", "eval.mode=best"], "eval.mode='best': must be one of random, mode, mean, deterministic"),
    (["eval.interval=100", "+eval.envs.other.id=Acrobot-v1"],
     "eval.envs.other: its env's observations or actions"),
    (["eval.video=true", "env.factory._target_=tests.fakes.SlowEnvFactory", "+env.factory.delay=0"],
     "eval.video=true: cannot record videos of SlowEnvFactory envs"),
])
def test_bad_eval_settings_are_one_line_and_write_nothing(tmp_path, args, message):
    run_dir = tmp_path / "bad"
    result = run_pipeline([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "videos").exists()


def test_an_extra_eval_env_is_logged_under_its_name(tmp_path):
    run_dir = tmp_path / "extra"
    result = run_pipeline(["eval.interval=1024", "eval.episodes=2", "+eval.envs.short.factory.kwargs.max_episode_steps=20",
                           "trainer.total_frames=2048", "trainer.target_return=null", "logger=jsonl",
                           "progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "also on short (eval.envs, eval/<name>/*)" in result.stdout
    summary = json.loads(Path(run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["eval/short/return_mean"] <= 20 and summary["eval/short/length_mean"] <= 20
    assert "eval/return_mean" in summary


@pytest.mark.slow
def test_the_video_cost_benchmark_runs_the_three_ways_and_reports_ratios(tmp_path, capsys):
    from pipeline.bench.video_cost import main

    assert main(["--frames", "2048", "--every", "1024", "--repeats", "1", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out.split("| run |", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == ["no-eval", "eval", "eval+video"]
    assert "| 1.00x |" in rows[1]
    assert len(list(tmp_path.glob("eval+video-0/videos/*.mp4"))) >= 1
