"""Where a served request's time to first token goes, stage by stage, as Prometheus
histograms (`tllm:ttft_stage_seconds{stage=...}`) and sliding-window percentiles:

    server     HTTP handler start -> handed to the engine (parsing, tokenizing, admission)
    handoff    handed over -> the engine's Request exists (pipe, engine process main thread)
    queue      the Request exists -> first scheduled (executor inbox, waiting queue)
    prefill    first scheduled -> first token on the engine's host (the prompt's steps)
    return     first token -> first token in the HTTP handler (delta batching, pipe, the
               server's event loop), the moment its SSE chunk is written

The five add up to the server-side TTFT. Engine times come back with a request's final
delta as monotonic clock readings, one clock for every process of the host (Linux
CLOCK_MONOTONIC), so stages that cross the process boundary are differences of readings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Histogram

STAGES = ("server", "handoff", "queue", "prefill", "return")
STAGE_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04,
                 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5,
                 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
STAGE_METRIC = "tllm:ttft_stage_seconds"


@dataclass
class ServerTimes:
    """A request's server-side readings (time.monotonic)."""

    arrival: float              # the HTTP handler began
    submitted: float | None = None     # handed to the engine
    first_token: float | None = None   # its first token reached the handler


def stage_seconds(server: ServerTimes, engine: dict[str, float]) -> dict[str, float] | None:
    """Each stage's duration, or None when a reading is missing (a failed or aborted
    request, an engine that reports no times)."""
    readings = (server.arrival, server.submitted, engine.get("arrival_time"),
                engine.get("first_scheduled_time"), engine.get("first_token_time"),
                server.first_token)
    if any(r is None for r in readings):
        return None
    return {stage: max(0.0, later - earlier)
            for stage, earlier, later in zip(STAGES, readings, readings[1:])}


class TtftBreakdown:
    """The stage histograms (in `registry`) and a sliding window per stage (`new_window`:
    metrics.WindowedQuantiles, passed in since that module builds this one)."""

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 new_window: Callable[[], object]) -> None:
        histogram = Histogram(STAGE_METRIC, "Time to first token by stage: server, handoff "
                              "(to the engine process), queue, prefill, return (to the HTTP "
                              "handler).", ["model_name", "stage"], buckets=STAGE_BUCKETS,
                              registry=registry)
        self._histograms = {stage: histogram.labels(model_name, stage) for stage in STAGES}
        self.recent = {stage: new_window() for stage in STAGES}

    def observe(self, server: ServerTimes, engine: dict[str, float]) -> None:
        stages = stage_seconds(server, engine)
        if stages is None:
            return
        for stage, seconds in stages.items():
            self._histograms[stage].observe(seconds)
            self.recent[stage].observe(seconds)

    def percentiles(self, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, list]:
        """Each stage's recent quantiles in seconds (None before any observation)."""
        return {stage: window.quantiles(qs) for stage, window in self.recent.items()}
