"""What an env may return against its spec, and the one line that says when it does not.

:class:`~components.collector.env_block.EnvBlock` writes every env's outputs
straight into fixed-shape arrays laid out from the env's spec. numpy's own
rules for such a write are both too loose and too strict for env outputs: it
silently broadcasts a scalar or a ``(1, 4)`` observation into a ``(4,)`` row
and parses a string reward as a number, yet refuses a ``(1,)``-shaped reward
with "setting an array element with a sequence" and a changed observation
shape with "could not broadcast input array", words that name neither the
env nor its spec. The block therefore accepts a value on its fast path only
when it is exactly what the spec says (one ``type``/``shape``/``dtype``
compare per leaf) and hands anything else to the functions here, which either
return the value in a form the write takes or raise :class:`OffSpec`, which
the block turns into a ``ValueError`` naming the env, the leaf, what it
returned and what the spec promises (a plain ``ValueError``, like the
non-finite check's, so the worker's failure line reads ``ValueError: env 6
broke its spec ...``). A violation is an env crash like any other: the worker
fails and is restarted within ``workers.max_restarts``.

Why compare instead of only diagnosing a write that raised: the writes that
do not raise are the worse bugs (a broadcast scalar observation, a parsed
string reward, an object array), and the compares cost about 0.2 us per env
step and 0.5 us per block step on a 9 us block step (``EnvBlock`` with
envs that take no time; measured in the notes of issue 21), against an env
step of several microseconds at the least.

Why cast a same-kind dtype instead of refusing it: gymnasium's checker only
warns about a dtype other than the space's and its vector envs write the
value on, and envs that compute in float64 under a float32 space are common;
a cast within a kind loses precision, not meaning. A cast across kinds
(float into an integer spec) or from a non-numeric dtype loses meaning, so
it is refused.

What is accepted, as gymnasium accepts it (its checker warns, its vector envs
write the value on):

- observations: an array, numpy scalar or list of exactly the spec's shape
  whose dtype casts to the spec's within its kind (``same_kind``: float64 to
  float32, int64 to uint8, bool to float); the spec's bounds are not checked,
  so a narrowing integer cast wraps out-of-range values, as the direct write
  always did. Refused: another shape (numpy would broadcast a scalar or a
  ``(1, 4)`` array, hiding the bug), a dtype of another kind (a float frame
  for a uint8 spec would truncate every pixel to 0; an object or string
  array is not numeric at all), a dict or a ragged list;
- rewards: a Python or numpy number (bool included) or an array of shape
  ``()`` or ``(1,)`` holding one; refused: strings (numpy would parse
  ``"1.0"``), complex numbers, longer arrays, lists, ``None``;
- ``terminated``/``truncated``: a Python or numpy bool, an integer 0 or 1, or
  an array of shape ``()`` or ``(1,)`` holding one; refused: floats, strings,
  ``None``, longer arrays;
- actions (what the policy hands the block): an array of shape
  ``(envs, *action_shape)``, integer for a discrete spec, numeric for a
  continuous one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from components.envs import EnvSpec

#: Reward types the block's fast path takes as they are (compared by identity: a subclass is checked).
FAST_REWARDS = (float, int, np.float64, np.float32, np.int64, bool)
#: Reward types :func:`check_reward` takes as they are (np.float64 is a float, bool an int).
NUMBERS = (float, int, np.floating, np.integer)
#: Flag types the fast path takes as they are.
FAST_FLAGS = (bool, np.bool_)

_NUMERIC = "biuf"


class OffSpec(ValueError):
    """A value off its spec; the message is what follows the env's name (``its reward is a str '1.0'; ...``)."""


def returned(value: Any, as_array: np.ndarray | None = None) -> str:
    """What a value is, in a spec's words: ``has shape (5,) float32``, ``is a str '1.0'``.

    ``as_array``: what a non-array value converted to (``is a list of shape (5,) float64``).
    """
    if isinstance(value, np.ndarray):
        return f"has shape {value.shape} {value.dtype}"
    if isinstance(value, np.generic):
        return f"is a numpy {value.dtype} scalar (shape ())"
    if isinstance(value, Mapping):
        keys = ", ".join(repr(k) for k in list(value)[:4]) + (", ..." if len(value) > 4 else "")
        return f"is a {type(value).__name__} (keys {keys})"
    if as_array is not None:
        return f"is a {type(value).__name__} of shape {as_array.shape} {as_array.dtype}"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"is a {type(value).__name__} {text}"


def observation_promise(spec: EnvSpec) -> str:
    return f"shape {tuple(spec.obs_shape)} {spec.obs_dtype}"


def check_observation(value: Any, spec: EnvSpec) -> np.ndarray:
    """``value`` as an array the spec's observation row takes; :class:`OffSpec` if it is none.

    The message is the part after the env's name (``its observation ...``):
    :func:`violation` adds who and when.
    """
    promise = f"the observation space promises {observation_promise(spec)}"
    if isinstance(value, Mapping):
        raise OffSpec(f"its observation {returned(value)}; {promise}")
    try:
        array = value if isinstance(value, np.ndarray) else np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # a ragged list, an int too large for any dtype
        raise OffSpec(f"its observation {returned(value)}, which is not an array; {promise}") from None
    target = np.dtype(spec.obs_dtype)
    if array.shape != tuple(spec.obs_shape):
        raise OffSpec(f"its observation {returned(value, array)}; {promise}")
    if array.dtype.kind not in _NUMERIC or not np.can_cast(array.dtype, target, casting="same_kind"):
        why = "not numeric" if array.dtype.kind not in _NUMERIC else f"no same-kind cast to {target}"
        raise OffSpec(f"its observation {returned(value, array)} ({why}); {promise}")
    return array


def _one(value: Any) -> Any:
    """The single element of a 0-d or shape-(1,) array; None for anything else."""
    if isinstance(value, np.ndarray) and value.shape in ((), (1,)):
        return value.reshape(()).item() if value.dtype.kind in _NUMERIC else None
    if isinstance(value, np.bool_):
        return bool(value)
    return None


def check_reward(value: Any) -> float | int:
    """A scalar-like reward as a number; :class:`OffSpec` if it is none."""
    if isinstance(value, NUMBERS):
        return value
    number = _one(value)
    if number is None:
        raise OffSpec(f"its reward {returned(value)}; a reward must be a number "
                      f"(a float, int or numpy scalar, or an array of shape () or (1,))")
    return number


def check_flag(value: Any, leaf: str) -> bool:
    """A scalar-like ``terminated``/``truncated`` as a bool; :class:`OffSpec` if it is none."""
    if isinstance(value, FAST_FLAGS):
        return bool(value)
    flag = value if isinstance(value, (int, np.integer)) else _one(value)
    if isinstance(flag, (bool, int, np.integer)) and flag in (0, 1):
        return bool(flag)
    raise OffSpec(f"its {leaf} {returned(value)}; {leaf} must be a bool "
                  f"(or 0/1, or an array of shape () or (1,) holding one)")


def check_actions(actions: Any, spec: EnvSpec, env_ids: np.ndarray) -> None:
    """Raise the full ``ValueError`` when the policy's actions for ``env_ids`` are off the spec."""
    rows = (len(env_ids), *spec.action_shape)
    if spec.action_kind == "discrete":
        promise, kinds = f"shape {rows} integer (Discrete({spec.action_n}))", "iu"
    elif spec.action_kind == "multi_discrete":
        promise, kinds = f"shape {rows} integer (MultiDiscrete({list(spec.action_nvec)}))", "iu"
    elif spec.action_kind == "multi_binary":
        promise, kinds = f"shape {rows} 0/1 integer (MultiBinary)", "iub"
    else:
        promise, kinds = f"shape {rows} float", "fiu"
    if isinstance(actions, np.ndarray) and actions.shape == rows and actions.dtype.kind in kinds:
        return
    raise ValueError(f"the policy's action batch for {_envs(env_ids)} {returned(actions)}; "
                     f"the action space promises {promise}")


def _envs(env_ids: np.ndarray) -> str:
    ids = [int(i) for i in env_ids]
    if len(ids) == 1:
        return f"env {ids[0]}"
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"envs {ids[0]}-{ids[-1]}"
    return "envs " + ", ".join(str(i) for i in ids)


def violation(env: int, when: str, err: OffSpec) -> ValueError:
    """The full one-line error: ``env 6 broke its spec at its step 3: its observation has ...``."""
    return ValueError(f"env {env} broke its spec {when}: {err}")
