"""Helpers the GPU benchmark scripts share (gpu_fastpath.py, gpu_fp8.py): a stream that
writes to several (the console and the run's log), rounding up, and the busy time of a set
of possibly overlapping intervals (a profiler trace's kernels)."""
from __future__ import annotations


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
