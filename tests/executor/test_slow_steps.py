import logging

import pytest

from tllm.executor import slow_steps
from tllm.executor.slow_steps import SlowIterationLog


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(slow_steps.ENV, raising=False)
    assert SlowIterationLog().start() is slow_steps._NO_CLOCK


def test_a_slow_iteration_is_logged_with_its_phases(monkeypatch, caplog):
    times = iter([0.0, 0.010, 0.260, 0.270])  # start, launch, complete, done
    monkeypatch.setattr(slow_steps.time, "perf_counter", lambda: next(times))
    clock = SlowIterationLog("100").start()
    clock.mark("launch")
    clock.mark("complete")
    with caplog.at_level(logging.WARNING, logger=slow_steps.__name__):
        clock.done(running=3, waiting=1)
    assert "slow executor iteration: 270.0 ms (launch 10.0, complete 250.0 ms; running 3, " \
           "waiting 1)" in caplog.text


def test_a_fast_iteration_is_not_logged(caplog):
    clock = SlowIterationLog("10000").start()
    clock.mark("launch")
    with caplog.at_level(logging.WARNING, logger=slow_steps.__name__):
        clock.done(running=1)
    assert not caplog.text


def test_a_bad_threshold_names_the_variable():
    with pytest.raises(ValueError, match=slow_steps.ENV):
        SlowIterationLog("soon")
