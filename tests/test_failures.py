"""Failure kinds and the restart budget local workers and Ray hosts share."""

from __future__ import annotations

import pickle
import time

import pytest

from components.collector.failures import CollectorError, Failure, FailureKind, RestartBudget
from components.collector.worker_control import FAILED, WorkerControl


def test_a_crash_is_admitted_up_to_the_budget_per_part_then_the_budget_is_spelled_out():
    budget = RestartBudget(2, window=60.0)
    crash = Failure("env worker 1 (envs 4-7) failed: RuntimeError: boom")
    assert [budget.admit(1, crash), budget.admit(1, crash), budget.admit(0, crash)] == [1, 2, 1]
    with pytest.raises(CollectorError) as caught:
        budget.admit(1, crash)
    assert str(caught.value) == ("env worker 1 (envs 4-7) failed: RuntimeError: boom "
                                 "(after 2 restart(s) within 60 s; workers.max_restarts=2)")
    assert budget.count == 3


def test_restarts_older_than_the_window_no_longer_count():
    budget = RestartBudget(1, window=0.05)
    budget.admit("a", Failure("x"))
    time.sleep(0.1)
    assert budget.admit("a", Failure("x")) == 1


@pytest.mark.parametrize("kind", [FailureKind.BUILD, FailureKind.NON_FINITE])
def test_a_failure_that_would_recur_is_never_restarted_and_keeps_its_own_line(kind):
    budget = RestartBudget(5, window=60.0)
    with pytest.raises(CollectorError) as caught:
        budget.admit(0, Failure("env worker 0 could not build its envs: OSError('no rom')", kind))
    assert str(caught.value) == "env worker 0 could not build its envs: OSError('no rom')"
    assert caught.value.kind is kind and budget.count == 0


def test_no_budget_fails_with_the_plain_line():
    with pytest.raises(CollectorError, match=r"^boom$"):
        RestartBudget(0, 60.0).admit(0, Failure("boom"))


def test_a_collector_error_keeps_its_kind_through_pickling():
    err = pickle.loads(pickle.dumps(CollectorError("env 3 returned a non-finite reward nan", FailureKind.NON_FINITE)))
    assert str(err) == "env 3 returned a non-finite reward nan" and err.kind is FailureKind.NON_FINITE
    assert CollectorError("stalled").kind is FailureKind.CRASH


def test_a_worker_says_its_failure_and_kind_through_shared_memory():
    control = WorkerControl(2)
    control.fail(1, "env worker 1 could not build its envs: ValueError('x')", FailureKind.BUILD)
    assert control.status[1] == FAILED and control.status[0] != FAILED
    assert control.failure(1) == Failure("env worker 1 could not build its envs: ValueError('x')", FailureKind.BUILD)
    clone = pickle.loads(pickle.dumps(control))  # what a process worker receives
    clone.fail(0, "env worker 0 (envs 0-3) failed: RuntimeError: boom")
    assert control.failure(0) == Failure("env worker 0 (envs 0-3) failed: RuntimeError: boom", FailureKind.CRASH)
