"""Small stand-in models with observable behaviour for server and transport tests."""

from __future__ import annotations

import threading
import time

import torch


class RecordingModel(torch.nn.Module):
    """action = round(sum of the observation row) * scale + mode; records batch sizes.

    ``scale`` is a buffer, so weight updates change the actions; observations
    with a NaN make the forward raise (a model error one request can cause);
    an observation of -999 kills whatever runs the server (a fatal fault:
    ``SystemExit`` is not an ``Exception`` the serve loop isolates).
    """

    in_keys = ("observation",)

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))
        self.delay = delay
        self.gate = gate
        self.batch_sizes: list[int] = []

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor) -> dict[str, torch.Tensor]:
        obs = torch.as_tensor(inputs["observation"])
        modes = torch.as_tensor(modes)
        if self.gate is not None:
            self.gate.wait(10)
        if torch.isnan(obs).any():
            raise ValueError("NaN in the observation")
        if (obs == -999).any():
            raise SystemExit("fatal fault in the served model")
        self.batch_sizes.append(obs.shape[0])
        if self.delay:
            time.sleep(self.delay)
        rows = obs.reshape(obs.shape[0], -1).sum(-1)
        return {"action": (rows.round() * self.scale).long() * 10 + modes.long()}


def make_recording_model(spec, delay: float = 0.0) -> RecordingModel:  # noqa: ANN001
    """ModelSpec-compatible builder, so a server process can rebuild the fake."""
    return RecordingModel(delay=delay)


def _first_to_claim(path: str) -> bool:
    import os

    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class FaultyEnvFactory:
    """CartPole whose envs fail from their ``at_step``-th step (each env counts its own).

    ``fault``: "raise" (an env that crashes), "hang" (a step that blocks for
    an hour: a hung simulator), "nan_reward" (a NaN reward) or "nan_obs"
    (an all-NaN observation). Usable from the
    command line: ``env.factory._target_=tests.fakes.FaultyEnvFactory
    +env.factory.at_step=30 +env.factory.fault=nan_reward``.
    """

    def __init__(self, at_step: int, fault: str = "raise", id: str = "CartPole-v1",  # noqa: A002
                 once: str | None = None) -> None:
        if fault not in ("raise", "hang", "nan_reward", "nan_obs"):
            raise ValueError(f"unknown fault {fault!r}")
        self.at_step, self.fault, self.id, self.once = at_step, fault, id, once

    def __call__(self):  # noqa: ANN204
        import gymnasium as gym

        at_step, fault, once = self.at_step, self.fault, self.once

        class Faulty(gym.Wrapper):
            steps = 0

            def step(self, action):  # noqa: ANN001, ANN202
                Faulty.steps += 1
                # ``once``: a marker file; only the first env to create it fails (a restart then succeeds)
                if Faulty.steps >= at_step and (once is None or _first_to_claim(once)):
                    if fault == "hang":
                        time.sleep(3600)
                    if fault == "nan_reward":
                        obs, reward, term, trunc, info = self.env.step(action)
                        return obs, float("nan"), term, trunc, info
                    if fault == "nan_obs":
                        obs, reward, term, trunc, info = self.env.step(action)
                        return obs * float("nan"), reward, term, trunc, info
                    raise RuntimeError(f"boom at step {at_step}")
                return self.env.step(action)

        return Faulty(gym.make(self.id))


class ExplodingEnvFactory(FaultyEnvFactory):
    def __init__(self, at_step: int) -> None:
        super().__init__(at_step, "raise")


class HangingEnvFactory(FaultyEnvFactory):
    def __init__(self, at_step: int) -> None:
        super().__init__(at_step, "hang")


class StallingPolicy(torch.nn.Module):
    """Acts (action 0) for ``answer`` calls, then never answers again: a server that stopped answering."""

    in_keys = ("observation",)

    def __init__(self, answer: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))
        self.answer = answer
        self.calls = 0

    def act(self, inputs: dict[str, torch.Tensor], modes: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls > self.answer:
            time.sleep(3600)
        obs = torch.as_tensor(inputs["observation"])
        return {"action": torch.zeros(obs.shape[0], dtype=torch.int64)}


def make_stalling_policy(spec, answer: int = 20) -> StallingPolicy:  # noqa: ANN001
    return StallingPolicy(answer)

