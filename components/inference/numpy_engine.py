"""The numpy serving engine, without torch: a small MLP policy from a recipe and numpy weights.

Why a second engine at all: on the CPU, for the 1-256-row batches a server
or an env worker evaluates, torch pays a few microseconds of dispatch per
op (and, on the AVX-512 build this project is measured on, a tanh about 6x
slower than numpy's); measured on the CartPole MLP, numpy serves a 64-row
batch in 54 us against torch's 149 us.

Why without torch: with ``server=inline`` every env worker process holds a
copy of the policy, and importing torch costs each of them about a second
of CPU and ~190 MB. A *recipe* (which state-dict keys form which layers,
with which activation; made once from the torch model by
:func:`components.inference.serving.numpy_recipe`) plus the weights as
numpy arrays (read from the shared weights arena) is all this module
needs, so a worker never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from components.action_noise import NOISE_KEY, fresh_uniforms
from components.interaction import InteractionMode

#: ``(weight key, bias key, activation or None)`` per linear layer, in order
LayerKeys = list[tuple[str, str, "str | None"]]
Layers = list[tuple[np.ndarray, np.ndarray, "str | None"]]


def _activate(x: np.ndarray, activation: str | None) -> np.ndarray:
    if activation == "tanh":
        np.tanh(x, out=x)
    elif activation == "relu":
        np.maximum(x, 0.0, out=x)
    return x


#: input columns converted to float at a time when a row is wide and not float32 (see :func:`first_product`)
CONVERT_COLUMNS = 4096


def first_product(x: np.ndarray, weight: np.ndarray,
                  norm: tuple[np.ndarray, np.ndarray, float] | None = None) -> np.ndarray:
    """``float32(x)`` (normalised by ``norm`` if given) ``@ weight``, converting wide rows a block of columns at a time.

    Why blocks: a raw 210x160x3 uint8 screen is 100,800 columns. Converting
    8 such rows at once writes 3.2 MB of floats that the product then reads
    back from beyond the 4 MB L2 it shares with the 6.5 MB weight; a block of
    4,096 columns (128 KB for 8 rows) is read back while it is still in the
    cache. Measured on the 2-CPU machine, 8 rows of 100,800 columns times 16
    outputs: 846-897 us at once, 637-667 us in blocks (16 rows: 1,216-1,273
    against 1,101-1,201). The sums run in a different order, so results
    differ from the one product by float rounding only.
    """
    n, width = x.shape
    if norm is None and x.dtype == np.float32:
        return x @ weight
    if width <= CONVERT_COLUMNS:
        xf = x.astype(np.float32, copy=False)
        if norm is not None:
            mean, inv_std, clip = norm
            xf = np.clip((xf - mean) * inv_std, -clip, clip)
        return xf @ weight
    out = np.zeros((n, weight.shape[1]), np.float32)
    part = np.empty_like(out)
    block = np.empty((n, CONVERT_COLUMNS), np.float32)
    for start in range(0, width, CONVERT_COLUMNS):
        end = min(width, start + CONVERT_COLUMNS)
        b = block[:, : end - start]
        np.copyto(b, x[:, start:end], casting="unsafe")
        if norm is not None:
            mean, inv_std, clip = norm
            b -= mean[start:end]
            b *= inv_std[start:end]
            np.clip(b, -clip, clip, out=b)
        np.matmul(b, weight[start:end], out=part)
        out += part
    return out


def apply_layers(x: np.ndarray, layers: Layers) -> np.ndarray:
    for weight, bias, activation in layers:
        x = x @ weight
        x += bias
        _activate(x, activation)
    return x


def load_layers(arrays: Mapping[str, np.ndarray], keys: LayerKeys) -> Layers:
    """Weights transposed for ``x @ W`` (and copied: the arrays may be shared memory)."""
    return [(np.ascontiguousarray(np.asarray(arrays[w], np.float32).T), np.array(arrays[b], np.float32), act)
            for w, b, act in keys]


def _as_numpy(value: Any) -> np.ndarray:
    return value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray) else np.asarray(value)


def _greedy(modes: Any) -> np.ndarray | None:
    if modes is None:
        return None
    greedy = _as_numpy(modes) != int(InteractionMode.RANDOM)
    return greedy if greedy.any() else None


class _RecipeEngine:
    """A numpy policy rebuilt from ``recipe`` and ``state()`` (the weights by state-dict key)."""

    in_keys = ("observation",)
    name = "numpy"

    def __init__(self, recipe: Mapping[str, Any], state: Callable[[], Mapping[str, np.ndarray]],
                 seed: int | None = None) -> None:
        self.recipe = dict(recipe)
        self._state = state
        self._rng = np.random.default_rng(seed)
        self._setup()
        self.refresh()

    def _setup(self) -> None:
        """What the recipe fixes once (before the first :meth:`load`)."""

    def refresh(self) -> None:
        """Re-read the weights (after every weight update)."""
        self.load(self._state())

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        raise NotImplementedError


class NumpyActorCriticEngine(_RecipeEngine):
    """An MLP actor-critic's ``act`` (discrete or Gaussian actions), from a recipe and numpy weights.

    The first layers of actor and critic read the same input, so they run
    as one matrix product.
    """

    def _setup(self) -> None:
        self._discrete = bool(self.recipe["discrete"])
        self._action_shape = tuple(self.recipe.get("action_shape", ()))
        self._rows = np.arange(0)
        # uniforms per row, as the torch heads' noise_width (one for a categorical, two per Gaussian dim)
        self._noise_width = 1 if self._discrete else 2 * int(np.prod(self._action_shape, dtype=np.int64))

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        r = self.recipe
        actor, critic = load_layers(arrays, r["actor"]), load_layers(arrays, r["critic"])
        (wa, ba, act_a), (wc, bc, act_c) = actor[0], critic[0]
        self._first = (np.concatenate([wa, wc], 1), np.concatenate([ba, bc]))
        self._first_act = (act_a, act_c)
        self._split = wa.shape[1]
        self._actor, self._critic = actor[1:], critic[1:]
        if not self._discrete:
            self._log_std = np.array(arrays[r["log_std"]], np.float64)
        norm = r.get("norm")
        if norm is None:
            self._norm = None
        else:
            mean = np.asarray(arrays[norm["mean"]], np.float64)
            var = np.asarray(arrays[norm["var"]], np.float64)
            self._norm = (mean.astype(np.float32), (1.0 / np.sqrt(var + norm["eps"])).astype(np.float32),
                          float(norm["clip"]))

    def act(self, inputs: dict[str, Any], modes: Any = None) -> dict[str, np.ndarray]:
        obs = _as_numpy(inputs["observation"])
        n = obs.shape[0]
        if self._rows.shape[0] < n:
            self._rows = np.arange(max(n, 256))
        weight, bias = self._first
        h = first_product(obs.reshape(n, -1), weight, self._norm)
        h += bias
        ha = _activate(h[:, : self._split], self._first_act[0])
        hc = _activate(h[:, self._split :], self._first_act[1])
        params = apply_layers(ha, self._actor)
        value = apply_layers(hc, self._critic)[:, 0]
        greedy = _greedy(modes)
        noise = inputs.get(NOISE_KEY)
        noise = fresh_uniforms(self._rng, n, self._noise_width) if noise is None else _as_numpy(noise)
        if self._discrete:
            z = params - params.max(1, keepdims=True)
            mass = np.exp(z)
            cdf = np.cumsum(mass, 1)
            log_probs = z - np.log(cdf[:, -1:])
            # the inverse CDF of the row's uniform, as components.heads.inverse_cdf: the cdf is monotone and its
            # last entry is never below u * itself (u < 1), so the first entry not below is the count of those below
            action = (cdf < noise[:, :1] * cdf[:, -1:]).argmin(1)
            if greedy is not None:
                action = np.where(greedy, log_probs.argmax(1), action)
            log_prob = log_probs[self._rows[:n], action]
            action = action.astype(np.int64, copy=False)
        else:
            std = np.exp(self._log_std)
            half = params.shape[1]
            normal = np.sqrt(-2.0 * np.log(noise[:, :half])) * np.cos((2.0 * np.pi) * noise[:, half:])
            action = params + std * normal
            if greedy is not None:
                action = np.where(greedy[:, None], params, action)
            log_prob = (-((action - params) ** 2) / (2 * std**2) - self._log_std - 0.5 * np.log(2 * np.pi)).sum(1)
            action = action.astype(np.float32).reshape(n, *self._action_shape)
        return {
            "action": action,
            "sample_log_prob": log_prob.astype(np.float32, copy=False),
            "state_value": np.ascontiguousarray(value, dtype=np.float32),
        }


class NumpyQNetworkEngine(_RecipeEngine):
    """An MLP Q-network's ``act``: greedy, or epsilon-greedy for rows in the random mode."""

    def _setup(self) -> None:
        self._actions = int(self.recipe["action_n"])

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        self._layers = load_layers(arrays, self.recipe["head"])
        self._epsilon = float(np.asarray(arrays[self.recipe["epsilon"]]))

    def act(self, inputs: dict[str, Any], modes: Any = None) -> dict[str, np.ndarray]:
        obs = _as_numpy(inputs["observation"])
        n = obs.shape[0]
        (weight, bias, activation), rest = self._layers[0], self._layers[1:]
        h = first_product(obs.reshape(n, -1), weight)
        h += bias
        q = apply_layers(_activate(h, activation), rest)
        action = q.argmax(1)
        if self._epsilon > 0:
            noise = inputs.get(NOISE_KEY)
            noise = fresh_uniforms(self._rng, n, 2) if noise is None else _as_numpy(noise)
            explore = noise[:, 0] < self._epsilon
            if modes is not None:
                explore &= _as_numpy(modes) == int(InteractionMode.RANDOM)
            if explore.any():  # as components.heads.epsilon_greedy
                random = np.minimum((noise[:, 1] * self._actions).astype(np.int64), self._actions - 1)
                action = np.where(explore, random, action)
        return {"action": action.astype(np.int64, copy=False)}


def engine_from_recipe(recipe: Mapping[str, Any], state: Callable[[], Mapping[str, np.ndarray]],
                       seed: int | None = None) -> NumpyActorCriticEngine | NumpyQNetworkEngine:
    """The numpy engine a recipe describes."""
    if recipe["kind"] == "q":
        return NumpyQNetworkEngine(recipe, state, seed)
    return NumpyActorCriticEngine(recipe, state, seed)
