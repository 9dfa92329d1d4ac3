"""A test instantiates every option of every group: the leaf objects a run builds, built for real.

For each option of each config group (composed with the overrides it needs,
as in ``tests/test_config.py``) the env factory is instantiated and called,
the model is built from the probed env spec the way ``pipeline/runner/run.py``
does (and acts once on a real observation), and the logger is instantiated
and closed. The trainer is left out on purpose (its ``_target_`` is not
part of this contract).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from components.envs import probe_env_spec
from components.metrics import MetricsLogger
from tests.conftest import compose
from tests.test_config import OPTIONS, option_overrides

HAS_ALE = importlib.util.find_spec("ale_py") is not None


def run_overrides(group: str, option: str) -> list[str]:
    """The overrides of ``tests/test_config.py`` plus what building the parts needs."""
    overrides = option_overrides(group, option)
    if group == "model" and option in ("nature_cnn", "cnn_lstm"):
        overrides.append("env=atari")  # a CNN needs image observations
    return overrides


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_of_every_group_instantiates(group, option, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    if group == "device" and option == "cuda" and not torch.cuda.is_available():
        pytest.skip("device=cuda needs a CUDA device")
    cfg = compose(*run_overrides(group, option))
    if "AtariEnvFactory" in str(cfg.env.factory._target_) and not HAS_ALE:
        pytest.skip("Atari needs ale_py (the atari extra)")
    for extra, module in (("box2d", "Box2D"), ("mujoco", "mujoco")):
        if option == extra:
            pytest.importorskip(module, reason=f"env={extra} needs the {extra} extra")

    # env factory: picklable, builds an env that resets and steps
    factory = instantiate(cfg.env.factory, _convert_="all")
    assert callable(factory)
    env = factory()
    try:
        obs, _ = env.reset(seed=0)
        env.step(env.action_space.sample())
    finally:
        env.close()

    # model, as the runner builds it (model.rnn picks the recurrent actor-critic)
    from pipeline.plan.model_spec import model_spec_for

    spec = model_spec_for(cfg)
    target = spec.target
    env_spec = probe_env_spec(factory)
    model = spec.build(env_spec)
    assert type(model).__name__ == target.rpartition(".")[2]
    assert sum(p.numel() for p in model.parameters()) > 0
    device = str(cfg.device.policy_device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    with torch.no_grad():
        out = model.act({"observation": torch.as_tensor(np.asarray(obs)[None], device=device)})
    action = out["action"].cpu().numpy()[0]
    if env.action_space.shape:  # Gaussian samples are unbounded; the env block clips them to the box
        action = np.clip(action, env.action_space.low, env.action_space.high).astype(env.action_space.dtype)
    assert env.action_space.contains(action if env.action_space.shape else int(action))

    if group != "logger":  # every logger option opens its sinks below; a wandb sink's finish costs ~2 s
        return
    logger = instantiate(cfg.logger, run_dir=tmp_path, name="t", run_config={}, _convert_="all", _recursive_=False)
    assert isinstance(logger, MetricsLogger)
    assert logger.sinks == ["jsonl", *[s for s in cfg.logger.sinks if s != "jsonl"]], "every sink opened"
    try:
        logger.log({"train/loss": 0.5}, frames=1)
    finally:
        logger.close()
    assert (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "tb").is_dir() == ("tensorboard" in cfg.logger.sinks)
    assert (tmp_path / "wandb").is_dir() == ("wandb" in cfg.logger.sinks)
