"""The runner's reading of interrupts: one that a C extension wrapped is still an interrupt, nothing else is."""

from __future__ import annotations

import pytest

from pipeline.runner import signals
from pipeline.runner.signals import Interrupted, interrupt_of, wrapped_interrupt


def _wrapped(inner: BaseException) -> SystemError:
    try:
        try:
            raise inner
        except BaseException:  # noqa: BLE001 - as Cython hands on a handler's exception
            raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set")  # noqa: B904
    except SystemError as err:
        return err


def test_an_interrupt_in_a_system_errors_context_is_found():
    err = _wrapped(Interrupted("SIGTERM"))
    assert isinstance(wrapped_interrupt(err), Interrupted) and str(interrupt_of(err)) == "SIGTERM"
    assert isinstance(interrupt_of(KeyboardInterrupt()), KeyboardInterrupt)


def test_any_other_system_error_is_raised_again(monkeypatch):
    monkeypatch.setattr(signals, "_PENDING", [])
    err = _wrapped(ValueError("a real bug"))
    assert wrapped_interrupt(err) is None
    with pytest.raises(SystemError, match="returned a result"):
        interrupt_of(err)


def test_a_system_error_without_context_after_a_noted_signal_is_that_signal(monkeypatch):
    monkeypatch.setattr(signals, "_PENDING", ["SIGTERM"])
    assert str(interrupt_of(SystemError("returned a result with an exception set"))) == "SIGTERM"
