"""Helpers the GPU benchmark scripts share (gpu_fastpath.py, gpu_fp8.py): a stream that
writes to several (the console and the run's log), rounding up, the busy time of a set of
possibly overlapping intervals (a profiler trace's kernels), and the watchdog that ends a
run past its budget."""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def interval_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


class Tee:
    """A text stream writing to every stream it was given."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


WATCHDOG_GRACE_S = 30.0  # past the budget: print what there is and exit


def start_watchdog(session, summary) -> None:
    """A hung part must not cost the figures already measured: WATCHDOG_GRACE_S past the
    session's end (`session.end`, perf_counter time), dump every thread's stack, record it in
    `session.results`, `session.save()`, print `summary(session)` and exit with 2."""
    def fire() -> None:
        print(f"WATCHDOG: {WATCHDOG_GRACE_S:.0f} s past the budget; stacks follow, then the "
              "summary so far", flush=True)
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        session.results["watchdog"] = "the run was stopped past its budget"
        session.save()
        print(summary(session), flush=True)
        os._exit(2)

    timer = threading.Timer(session.end - time.perf_counter() + WATCHDOG_GRACE_S, fire)
    timer.daemon = True
    timer.start()
