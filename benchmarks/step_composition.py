"""Per-step batch composition of an engine's scheduler (benchmark instrumentation, not a
product feature): for each scheduled step the running-batch size, its decodes, its prefill
tokens and when it was scheduled. `summarize` turns a run's steps into the figures that
explain a scheduling policy's throughput: mean running batch, how many steps mixed prefill
chunks into their decodes (those run eagerly; pure decode steps replay CUDA graphs), and the
host-side interval between schedule calls by kind of step.

    recorder = StepRecorder(llm._engine.executor.scheduler)   # wraps scheduler.schedule
    ... run requests ...
    summary = summarize(recorder.take())
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass
class StepRecord:
    time_s: float          # perf_counter when scheduled
    num_running: int       # the running batch after scheduling
    num_decodes: int       # requests computing one token they sample next (drafts too)
    num_prefill_tokens: int
    num_tokens: int


class StepRecorder:
    """Wraps `scheduler.schedule` on this instance (the executor thread calls it)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.steps: list[StepRecord] = []
        self._schedule = scheduler.schedule
        scheduler.schedule = self._record

    def _record(self):
        # Progress before scheduling tells decodes from prompt chunks: a decode has exactly
        # one token (plus drafts) left to compute.
        batch = self._schedule()
        if not batch.requests:
            return batch
        num_decodes, num_prefill = 0, 0
        for request, num_new in zip(batch.requests, batch.num_scheduled_tokens):
            is_decode = (request.num_tokens - request.num_computed_tokens == 1
                         and num_new == 1 + len(request.draft_token_ids))
            num_decodes += is_decode
            num_prefill += 0 if is_decode else num_new
        self.steps.append(StepRecord(time.perf_counter(), len(self.scheduler.running),
                                     num_decodes, num_prefill, batch.num_tokens))
        return batch

    def take(self) -> list[StepRecord]:
        steps, self.steps = self.steps, []
        return steps

    def close(self) -> None:
        self.scheduler.schedule = self._schedule


def summarize(steps: list[StepRecord], lag: int = 1) -> dict:
    """Mean running batch and decodes a step, mixed vs pure decode steps, and the median
    interval between schedule calls by step kind. With the overlapped loop (the default),
    the interval after step k's schedule call ends when step k - 1 finished on the device
    (`lag` 1), so it is attributed to step k - lag; a device-bound loop makes it that
    step's time."""
    if not steps:
        return {"num_steps": 0}
    intervals: dict[str, list[float]] = {"pure_decode": [], "mixed": [], "prefill_only": []}
    for k in range(lag, len(steps) - 1):
        intervals[_kind(steps[k - lag])].append((steps[k + 1].time_s - steps[k].time_s) * 1e3)
    kinds = {kind: sum(1 for s in steps if _kind(s) == kind) for kind in intervals}
    return {
        "num_steps": len(steps),
        "mean_running": statistics.mean(s.num_running for s in steps),
        "mean_decodes": statistics.mean(s.num_decodes for s in steps),
        "mean_prefill_tokens": statistics.mean(s.num_prefill_tokens for s in steps),
        "max_tokens": max(s.num_tokens for s in steps),
        "steps_by_kind": kinds,
        "median_interval_ms": {kind: statistics.median(v) if v else None
                               for kind, v in intervals.items()},
    }


def _kind(step: StepRecord) -> str:
    if not step.num_prefill_tokens:
        return "pure_decode"
    return "prefill_only" if not step.num_decodes else "mixed"


def running_curve(steps: list[StepRecord], every: int = 16) -> list[int]:
    """The running-batch size every `every` steps (the ramp, plateau and drain)."""
    return [s.num_running for s in steps[::every]]
