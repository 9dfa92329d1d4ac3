"""Per-env sampling noise: the uniforms an env's actions are drawn with, a pure function of (env seed, step).

Why: with one RNG per server, the action an env gets depends on which other
envs shared its batch (the draw it receives is the k-th of the batch's). Here
every env has its own counter-based stream (SplitMix64's: a 64-bit finaliser
over ``base + counter * golden``, ``base`` from the env's seed), and the
counter is the env's step index, so the noise of row ``(env, step)`` is the
same in any batch, any placement (thread, process, inline, Ray) and after a
worker restart (whose block starts past its predecessor's steps). The action
then depends only on the observation, the weights served and that noise.

The env side makes the noise (numpy, where the env's seed and step are
known) and sends it with the observation as the request field
:data:`NOISE_KEY`; heads turn uniforms into actions (inverse CDF for
categoricals, Box-Muller for Gaussians, see :mod:`components.heads`). A model
says how many uniforms a row needs with an ``action_noise_width`` attribute;
one without it gets no noise field and samples with its own RNG.

Cost: a block makes the noise of its next :data:`TABLE_STEPS` steps at once
(one vectorised hash), so a step costs a view, not a hash.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: the request field carrying each row's uniforms, ``[rows, width]`` float32 in (0, 1)
NOISE_KEY = "action_noise"
#: steps of noise a block makes at once
TABLE_STEPS = 64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S40 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(40)
#: separates the noise streams from anything else derived from the same env seed
_STREAM_TAG = np.uint64(0x6E6F697365AC7104)
_SMALLEST = np.float32(2.0**-25)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, in place on a uint64 array (wrapping arithmetic is numpy's for arrays)."""
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def noise_width(model: Any) -> int:
    """Uniforms per row ``model`` samples with (0: it brings its own randomness)."""
    return int(getattr(model, "action_noise_width", 0) or 0)


def stream_bases(seeds: Any) -> np.ndarray:
    """Each env's stream base, from its seed (uint64)."""
    z = np.asarray(seeds, np.int64).astype(np.uint64) ^ _STREAM_TAG
    return _mix(z * _GOLDEN)


def uniforms(bases: np.ndarray, steps: np.ndarray, width: int) -> np.ndarray:
    """The noise of env rows ``bases`` at their steps ``steps``: float32 ``[..., rows, width]`` in (0, 1).

    ``steps`` broadcasts against ``bases`` (``[rows]``, or ``[T, rows]`` for
    T steps at once). Each value has 24 random bits, so it is exact in
    float32 and never 0 or 1 (logarithms of it and of 1 - it are finite).
    """
    steps = np.asarray(steps, np.int64).astype(np.uint64)
    columns = np.arange(width, dtype=np.uint64) + np.uint64(1)
    counter = (steps[..., None] * np.uint64(width) + columns) * _GOLDEN + bases[..., None]
    bits = _mix(counter) >> _S40
    out = bits.astype(np.float32)
    out += np.float32(0.5)
    out *= np.float32(2.0**-24)
    return out


class BlockNoise:
    """The noise of a block of envs that all step together, made :data:`TABLE_STEPS` steps at a time.

    ``current(step)`` returns the ``[rows, width]`` uniforms for the block's
    envs at ``step`` (the step count they share): a view of a table made
    when the step first left it, so the block's per-step cost is one
    comparison of Python ints.
    """

    def __init__(self, seeds: Any, width: int) -> None:
        self.bases = stream_bases(seeds)
        self.width = int(width)
        self._origin = -1  # the step of the table's first row (-1: no table yet)
        self._table = np.zeros((0, len(self.bases), self.width), np.float32)
        self._offsets = np.arange(TABLE_STEPS, dtype=np.int64)[:, None]

    def current(self, step: int) -> np.ndarray:
        k = step - self._origin
        if self._origin >= 0 and 0 <= k < TABLE_STEPS:
            return self._table[k]
        self._origin = int(step)
        self._table = uniforms(self.bases, self._offsets + self._origin, self.width)  # [T, 1]: every env's step
        return self._table[0]


def rows_noise(seeds: Any, steps: Any, width: int) -> np.ndarray:
    """The noise of single env rows (a subset of a block, e.g. concurrently stepped envs), unamortised."""
    return uniforms(stream_bases(seeds), np.asarray(steps, np.int64), width)


def fresh_uniforms(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """Uniforms in (0, 1) like :func:`uniforms`' (24 bits) from ``rng``: for a caller with no env stream.

    numpy's float32 draws are multiples of 2**-24 in [0, 1); the one value
    that could break a logarithm, 0, becomes 2**-25.
    """
    out = rng.random((rows, width), dtype=np.float32)
    np.maximum(out, _SMALLEST, out=out)
    return out
