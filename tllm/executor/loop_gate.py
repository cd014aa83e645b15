"""The executor loop's gate for RL rollouts: whether it may launch steps (not while generation
is paused, the engine asleep, or its weights dropped by a level-2 sleep), what a request
submitted meanwhile gets (it waits, or fails at once under the "fail" policy), and the calls
that must run with no step in flight (sleep, wake, new weights)."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

SLEEP_MODE_POLICIES = ("wait", "fail")


class EngineAsleepError(RuntimeError):
    """A request submitted while the engine sleeps, under sleep_mode_policy="fail" (or
    while its weights are dropped by sleep(level=2) and no new ones have come)."""


class LoopGate:
    """Read by the loop thread each iteration; set from any thread (plain flags)."""

    def __init__(self, sleep_mode_policy: str = "wait") -> None:
        if sleep_mode_policy not in SLEEP_MODE_POLICIES:
            raise ValueError(f"sleep_mode_policy must be one of "
                             f"{', '.join(SLEEP_MODE_POLICIES)}, got {sleep_mode_policy!r}")
        self.sleep_mode_policy = sleep_mode_policy
        self.is_paused = False
        self.is_sleeping = False
        self.needs_weights = False     # sleep(level=2) dropped them: update before generating
        self._quiet_calls: list[tuple[Callable[[], object], Future]] = []
        self._lock = threading.Lock()

    @property
    def holds_launches(self) -> bool:
        return self.is_paused or self.is_sleeping or self.needs_weights

    def check_submit(self) -> None:
        """EngineAsleepError for a request the policy refuses now."""
        if self.sleep_mode_policy != "fail":
            return
        if self.is_sleeping:
            raise EngineAsleepError("the engine is asleep (sleep_mode_policy='fail'): "
                                    "wake_up() first")
        if self.needs_weights:
            raise EngineAsleepError("the engine's weights were dropped by sleep(level=2): "
                                    "load new ones (update_weights, "
                                    "update_weights_from_disk) first")

    def add_quiet_call(self, fn: Callable[[], object]) -> Future:
        """fn's future; the loop runs fn once no step is in flight."""
        future: Future = Future()
        with self._lock:
            self._quiet_calls.append((fn, future))
        return future

    @property
    def has_quiet_calls(self) -> bool:
        return bool(self._quiet_calls)

    def run_quiet_calls(self) -> None:
        """(Loop thread, no step in flight.) Each call's result or error to its future."""
        with self._lock:
            calls, self._quiet_calls = self._quiet_calls, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as exc:   # the caller gets it; the loop goes on
                future.set_exception(exc)

    def fail_quiet_calls(self, error: BaseException) -> None:
        """The loop has ended: nobody will run them."""
        with self._lock:
            calls, self._quiet_calls = self._quiet_calls, []
        for _, future in calls:
            future.set_exception(error)
