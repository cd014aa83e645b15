"""Helpers the GPU benchmark scripts share (gpu_fastpath.py, gpu_fp8.py, gpu_pooling.py): a
stream that writes to several (the console and the run's log), rounding up, the busy time of
a set of possibly overlapping intervals (a profiler trace's kernels), the watchdog that ends
a run past its budget, and a profile of one call (wall time against GPU busy time)."""
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


def profile_call(fn, device) -> dict:
    """One fn() under torch.profiler: its wall time, the GPU's busy time in it (the union of
    kernels, copies and memsets), busy time per kernel category, the top kernels, and how
    many kernels and CUDA runtime calls it made (launches, syncs)."""
    import tempfile
    from collections import Counter
    from pathlib import Path

    import torch
    from gpu_fastpath import (_profiler, _trace_events, kernel_category, short_kernel_name,
                              trace_summary)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        with _profiler(device) as prof:
            sync()
            started = time.perf_counter()
            fn()
            sync()
            wall_ms = (time.perf_counter() - started) * 1e3
        prof.export_chrome_trace(str(path))
        trace = trace_summary(_trace_events(path))
    categories: Counter = Counter()
    for name, us in trace["per_name_us"].items():
        categories[kernel_category(name)] += us / 1e3
    top = trace["per_name_us"].most_common(6)
    return {"wall_ms": wall_ms, "gpu_busy_ms": trace["busy_us"] / 1e3,
            "gpu_busy_fraction": trace["busy_us"] / 1e3 / wall_ms if wall_ms else None,
            "category_ms": dict(categories.most_common()),
            "top_kernels": [{"name": short_kernel_name(name)[:120], "ms": us / 1e3,
                             "calls": trace["per_name_count"][name]} for name, us in top],
            "num_kernels": sum(trace["per_name_count"].values()),
            "runtime_calls": dict(trace["runtime"].most_common(6))}
