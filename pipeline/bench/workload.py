"""A benchmark workload as the runner sees it: the overrides of a ``python -m pipeline`` command.

Every contender, ours and the hand-written baselines alike, gets its env
factory and its network from the config those overrides compose to, so a
baseline steps the envs a training run would step and runs the policy it
would serve; ``ours:*`` contenders add their layout's overrides and go
through the runner's own validation, probes and plan
(:mod:`pipeline.bench.ours`).
"""

from __future__ import annotations

import copy
import re
import shlex
from functools import lru_cache
from typing import Any

import numpy as np


def base_overrides(workload: dict[str, Any], num_envs: int) -> list[str]:
    """The workload's command-line overrides at ``num_envs`` envs (the env, the model, the batch size)."""
    out = [str(o) for o in workload.get("overrides", [])]
    out += [f"env.num_envs={num_envs}", f"trainer.frames_per_batch={int(workload['frames_per_batch'])}"]
    device = str(workload.get("device", "cpu"))
    if device != "cpu":
        out.append(f"device.policy_device={device}")
    return out


def command(overrides: list[str]) -> str:
    """The command a user types for ``overrides`` (quoted for a POSIX shell)."""
    return " ".join(["python -m pipeline", *(shlex.quote(o) for o in overrides)])


@lru_cache(maxsize=8)
def _config(overrides: tuple[str, ...]) -> Any:
    from pipeline.plan.inputs import compose

    return compose(list(overrides))


def config(workload: dict[str, Any], num_envs: int | None = None) -> Any:
    """The composed config of the workload (``num_envs``: its own count when None); a copy the caller may change."""
    return copy.deepcopy(_config(tuple(base_overrides(workload, int(num_envs or workload["num_envs"])))))


def env_factory(workload: dict[str, Any]) -> Any:
    """The env factory the workload's config builds (as the runner's ``build_env`` does)."""
    from pipeline.plan.inputs import build_env

    return build_env(config(workload))[0]


def model_spec(workload: dict[str, Any]) -> Any:
    from pipeline.plan.model_spec import model_spec_for

    return model_spec_for(config(workload))


def engine(workload: dict[str, Any], env_spec: Any, device: str = "cpu") -> Any:
    """The workload's network in the serving engine ``server.engine=auto`` picks for it on ``device``."""
    from components.inference.serving import serving_engine

    model = model_spec(workload).build(env_spec).to(device).eval()
    return serving_engine(model, "auto", device, seed=0, obs_leaves=env_spec.obs_leaves)


def act(engine: Any, obs: np.ndarray, modes: np.ndarray) -> np.ndarray:
    """Actions of ``engine`` for a batch of observations, as numpy (a feed-forward policy)."""
    action = engine.act({"observation": obs}, modes)["action"]
    return action.numpy() if hasattr(action, "numpy") else action


class LoopPolicy:
    """A hand-written loop's policy: actions for a batch of observations, a recurrent state carried per row.

    What a baseline loop must do to run a recurrent model as the collector
    does: each row's state goes in with its observation, the next state comes
    back and is kept, zeroed where that row's episode ended (``done``), with
    ``is_first`` set there. A feed-forward model costs one dict lookup more
    than :func:`act`.
    """

    def __init__(self, engine: Any, rows: int) -> None:
        from components.recurrent_state import IS_FIRST, state_leaves

        self.engine = engine
        self._is_first_key = IS_FIRST
        leaves = state_leaves(getattr(engine, "model", None))
        self.state = {k: np.zeros((rows, *shape), np.float32) for k, shape in leaves.items()}
        self.is_first = np.ones(rows, bool)

    def __call__(self, obs: np.ndarray, modes: np.ndarray) -> np.ndarray:
        if not self.state:
            return act(self.engine, obs, modes)
        out = self.engine.act({"observation": obs, **self.state, self._is_first_key: self.is_first}, modes)
        for key, value in self.state.items():
            value[:] = out[f"next.{key}"].numpy() if hasattr(out[f"next.{key}"], "numpy") else out[f"next.{key}"]
        self.is_first[:] = False
        action = out["action"]
        return action.numpy() if hasattr(action, "numpy") else action

    def ended(self, done: np.ndarray) -> None:
        """Rows whose episode ended: their next step starts from zero state."""
        if self.state and done.any():
            for value in self.state.values():
                value[done] = 0.0
            self.is_first[done] = True


#: a contender name's model suffix: ``+lstm``, ``+gru``, optionally with the core's width (``+lstm256``)
_CORE_SUFFIX = re.compile(r"\+(lstm|gru)(\d+)?$")


def recurrent_variant(name: str, workload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``ours:auto+lstm128`` -> ``ours:auto`` with the workload's model given that recurrent core (else unchanged).

    Examples:
        >>> recurrent_variant("bare_procs+lstm256", {"overrides": ["env=atari"]})[1]["overrides"]
        ['env=atari', 'model.rnn=lstm', 'model.rnn_hidden=256']
    """
    found = _CORE_SUFFIX.search(name)
    if not found:
        return name, workload
    extra = [f"model.rnn={found.group(1)}"] + ([f"model.rnn_hidden={found.group(2)}"] if found.group(2) else [])
    return name[:found.start()], {**workload, "overrides": [*workload.get("overrides", []), *extra]}
