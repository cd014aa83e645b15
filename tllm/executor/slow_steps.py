"""`TLLM_LOG_SLOW_STEPS_MS=N`: warn about every executor iteration that takes over N ms,
with the time of each of its phases (launch: schedule + inputs + the forward's launch;
fetch: the inbox; complete: waiting for the oldest step's tokens; sample), to find what
stalls the loop under load. Off by default: then an iteration pays one attribute check."""
from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)
ENV = "TLLM_LOG_SLOW_STEPS_MS"


class _NoClock:
    def mark(self, phase: str) -> None:
        pass

    def done(self, **counts) -> None:
        pass


_NO_CLOCK = _NoClock()


class _Clock:
    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self.started = self.last = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self.last))
        self.last = now

    def done(self, **counts) -> None:
        took = time.perf_counter() - self.started
        if took > self.threshold_s:
            phases = ", ".join(f"{name} {s * 1e3:.1f}" for name, s in self.phases)
            what = ", ".join(f"{k} {v}" for k, v in counts.items())
            logger.warning("slow executor iteration: %.1f ms (%s ms; %s)", took * 1e3,
                           phases, what)


class SlowIterationLog:
    def __init__(self, threshold_ms: str | None = None) -> None:
        raw = os.environ.get(ENV, "") if threshold_ms is None else threshold_ms
        try:
            value = float(raw) if raw.strip() else 0.0
        except ValueError:
            raise ValueError(f"{ENV} must be a number of milliseconds, got {raw!r}") from None
        self.threshold_s = value / 1e3 if value > 0 else None

    def start(self) -> _Clock | _NoClock:
        return _NO_CLOCK if self.threshold_s is None else _Clock(self.threshold_s)
