"""Small stand-in models with observable behaviour for server and transport tests."""

from __future__ import annotations

import threading
import time

import torch


class RecordingModel(torch.nn.Module):
    """action = round(sum of the observation row) * scale + mode; records batch sizes.

    ``scale`` is a buffer, so weight updates change the actions; observations
    with a NaN make the forward raise (a model error one request can cause).
    """

    in_keys = ("observation",)

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))
        self.delay = delay
        self.gate = gate
        self.batch_sizes: list[int] = []

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor) -> dict[str, torch.Tensor]:
        obs = inputs["observation"]
        if self.gate is not None:
            self.gate.wait(10)
        if torch.isnan(obs).any():
            raise ValueError("NaN in the observation")
        self.batch_sizes.append(obs.shape[0])
        if self.delay:
            time.sleep(self.delay)
        rows = obs.reshape(obs.shape[0], -1).sum(-1)
        return {"action": (rows.round() * self.scale).long() * 10 + modes.long()}


def make_recording_model(spec, delay: float = 0.0) -> RecordingModel:  # noqa: ANN001
    """ModelSpec-compatible builder, so a server process can rebuild the fake."""
    return RecordingModel(delay=delay)


class ExplodingEnvFactory:
    """CartPole whose env ``index`` raises on its ``at_step``-th step (a crashing env)."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def __call__(self):  # noqa: ANN204
        import gymnasium as gym

        at_step = self.at_step

        class Exploding(gym.Wrapper):
            steps = 0

            def step(self, action):  # noqa: ANN001, ANN202
                Exploding.steps += 1
                if Exploding.steps >= at_step:
                    raise RuntimeError(f"boom at step {at_step}")
                return self.env.step(action)

        return Exploding(gym.make("CartPole-v1"))
