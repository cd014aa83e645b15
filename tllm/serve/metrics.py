"""Prometheus metrics of the server, with vLLM's names under a `tllm:` prefix. Engine gauges
are read from `LLM.get_stats()` at scrape time; request metrics are fed by a RequestTracker
per API request. Each server has its own registry, so several can live in one process."""
from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "RequestTracker", "ServerMetrics"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """The server's registry and its metrics."""

    def __init__(self, model_name: str, engine_stats: Callable[[], dict[str, int]]) -> None:
        disable_created_metrics()  # the *_created series only add noise (vLLM does the same)
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.prompt_tokens = self._counter("tllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = self._counter("tllm:generation_tokens", "Tokens generated.")
        success = Counter("tllm:request_success", "Finished sequences by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self.ttft = self._histogram("tllm:time_to_first_token_seconds",
                                    "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = self._histogram("tllm:inter_token_latency_seconds",
                                   "Time between consecutive tokens of a sequence.",
                                   ITL_BUCKETS)
        self.e2e = self._histogram("tllm:e2e_request_latency_seconds",
                                   "Time from arrival to the last token.", E2E_BUCKETS)
        self.queue_time = self._histogram("tllm:request_queue_time_seconds", "Time a request "
                                          "waited before it was first scheduled.", E2E_BUCKETS)
        self.request_prompt_tokens = self._histogram(
            "tllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation_tokens = self._histogram(
            "tllm:request_generation_tokens", "Generated tokens per sequence.", TOKEN_BUCKETS)
        self.http_requests = Counter("tllm:http_requests", "HTTP responses by endpoint and "
                                     "status.", ["endpoint", "status"], registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats, model_name))

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple):
        return Histogram(name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, prompt_lengths: list[int], num_samples: int,
              arrival: float | None = None) -> RequestTracker:
        """Start tracking an API request: each prompt runs num_samples sequences."""
        for length in prompt_lengths:
            self.prompt_tokens.inc(length)
            self.request_prompt_tokens.observe(length)
        return RequestTracker(self, len(prompt_lengths) * num_samples,
                              arrival if arrival is not None else time.monotonic())


class RequestTracker:
    """Timings and counts of one API request's sequences. A sequence that never reports its
    finish (the client went away, or the request failed) counts as aborted on close()."""

    def __init__(self, metrics: ServerMetrics, num_seqs: int, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._is_first_token = True
        self._last_token_time: list[float | None] = [None] * num_seqs
        self._num_tokens = [0] * num_seqs
        self._unfinished = set(range(num_seqs))

    def on_tokens(self, seq: int, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.monotonic()
        last = self._last_token_time[seq]
        if self._is_first_token:
            self._metrics.ttft.observe(now - self._arrival)
            self._is_first_token = False
        if last is not None:
            for _ in range(num_tokens):
                self._metrics.itl.observe((now - last) / num_tokens)
        self._last_token_time[seq] = now
        self._num_tokens[seq] += num_tokens
        self._metrics.generation_tokens.inc(num_tokens)

    def on_finish(self, seq: int, reason: str | None) -> None:
        if seq not in self._unfinished:
            return
        self._unfinished.discard(seq)
        metrics = self._metrics
        metrics.request_success[reason if reason in FINISH_REASONS else "abort"].inc()
        metrics.request_generation_tokens.observe(self._num_tokens[seq])
        if not self._unfinished:
            metrics.e2e.observe(time.monotonic() - self._arrival)

    def on_engine_metrics(self, engine_metrics: dict[str, float]) -> None:
        if "queue_s" in engine_metrics:
            self._metrics.queue_time.observe(engine_metrics["queue_s"])

    def close(self) -> None:
        for seq in sorted(self._unfinished):
            self.on_finish(seq, "abort")


class _EngineCollector:
    """Gauges read from the engine at scrape time."""

    def __init__(self, engine_stats: Callable[[], dict[str, int]], model_name: str) -> None:
        self._stats = engine_stats
        self._model = [model_name]

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except Exception:  # the engine is shut down: nothing to report
            return
        total = max(stats.get("kv_blocks_total", 0), 1)
        used = 1.0 - stats.get("kv_blocks_free", total) / total
        yield self._gauge("tllm:num_requests_running", "Sequences in the running batch.",
                          stats.get("num_running", 0))
        yield self._gauge("tllm:num_requests_waiting", "Sequences waiting to be scheduled.",
                          stats.get("num_waiting", 0))
        yield self._gauge("tllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use "
                          "(1 means full).", used)
        yield self._gauge("tllm:kv_cache_blocks_total", "KV cache blocks.", total)
        yield self._gauge("tllm:prefix_cache_hit_rate", "Prefix blocks found in the cache / "
                          "prefix blocks looked up.", stats.get("kv_hit_rate", 0.0))
        yield self._gauge("tllm:kv_cache_host_blocks", "Evicted blocks kept in host memory.",
                          stats.get("kv_host_blocks", 0))
        yield self._gauge("tllm:kv_cache_disk_blocks", "Evicted blocks kept on disk.",
                          stats.get("kv_disk_blocks", 0))
        for name, key, doc in (
                ("tllm:num_preemptions", "num_preemptions", "Preempted sequences."),
                ("tllm:prefix_cache_blocks_reused", "kv_blocks_reused",
                 "Prefix blocks reused instead of recomputed."),
                ("tllm:kv_cache_blocks_offloaded", "kv_blocks_offloaded",
                 "Blocks moved from the device to the host tier."),
                ("tllm:kv_cache_blocks_onboarded", "kv_blocks_onboarded",
                 "Blocks brought back from the host or disk tier.")):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(self._model, stats.get(key, 0))
            yield counter

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
        gauge.add_metric(self._model, value)
        return gauge
