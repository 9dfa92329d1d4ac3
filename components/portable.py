"""Callables that cross a spawn boundary whatever they are: lambdas and closures included.

A spawned worker receives its env factory by pickling. Plain pickle takes
only what it can import by name (a module-level class or function), so the
seed collector's own idiom, ``lambda: gym.make(...)``, or a factory built by
a function that closes over its arguments, failed with process workers.
:func:`portable` keeps whatever plain pickle can carry as it is (the child
imports it by name, as before) and wraps anything else so that it travels
by value with cloudpickle, which gymnasium already depends on.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any


def _by_value(payload: bytes) -> Callable[..., Any]:
    import cloudpickle

    return cloudpickle.loads(payload)


class _ByValue:
    """``fn`` pickled by value (cloudpickle); unpickles as ``fn`` itself, not as a wrapper."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        import cloudpickle

        return _by_value, (cloudpickle.dumps(self.fn),)


def portable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as it is when plain pickle carries it, else wrapped to travel by value.

    Raises the pickling error (one line, naming the type) when not even
    cloudpickle can carry it, e.g. a factory holding an open socket.
    """
    try:
        pickle.dumps(fn)
        return fn
    except Exception:  # noqa: BLE001 - any pickling failure: try by value
        pass
    import cloudpickle

    try:
        cloudpickle.dumps(fn)
    except Exception as err:  # noqa: BLE001 - named for the user below
        raise TypeError(f"the env factory {type(fn).__name__} cannot be sent to a process worker, not even by "
                        f"value: {type(err).__name__}: {err}") from None
    return _ByValue(fn)
