"""Prometheus metrics of the server, with vLLM's names under a `tllm:` prefix. Engine gauges
are read from `LLM.get_stats()` at scrape time; request metrics are fed by a RequestTracker
per API request. Each server has its own registry, so several can live in one process.
Beside the cumulative histograms, sliding windows (per-second buckets) give recent token
rates and latency percentiles for the dashboard."""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Iterator

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tllm.serve.http.ttft_breakdown import ServerTimes, TtftBreakdown

__all__ = ["CONTENT_TYPE_LATEST", "RequestTracker", "ServerMetrics", "WindowedCounter",
           "WindowedQuantiles"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)
FINISH_REASONS = ("stop", "length", "abort")
LATENCY_WINDOW_S = 300      # percentiles over the last 5 minutes
RATE_WINDOW_S = 10          # token rates over the last 10 seconds


class WindowedCounter:
    """Counts in per-second buckets over the last window_s seconds: a recent rate."""

    def __init__(self, window_s: int = RATE_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._start = clock()
        self._buckets: deque[list] = deque()    # [second, count]

    def add(self, count: float) -> None:
        second = int(self._clock())
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += count
        else:
            self._buckets.append([second, count])
        self._expire(second)

    def rate(self) -> float:
        """Per second over the window (or over the time since start, when shorter)."""
        now = self._clock()
        self._expire(int(now))
        span = min(self.window_s, max(now - self._start, 1e-3))
        return sum(count for _, count in self._buckets) / span

    def _expire(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - self.window_s:
            self._buckets.popleft()


class WindowedQuantiles:
    """Quantiles of the values observed in the last window_s seconds, from per-second
    histograms with log-spaced bins (values within 3% of the truth, [1e-4, 1e4] seconds): one
    observation costs a log and an increment, however high the rate."""

    _LOW, _BINS_PER_DECADE, _DECADES = 1e-4, 40, 8

    def __init__(self, window_s: int = LATENCY_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._num_bins = self._BINS_PER_DECADE * self._DECADES + 1
        self._buckets: deque[tuple[int, list[int]]] = deque()

    def observe(self, value: float, count: int = 1) -> None:
        second = int(self._clock())
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append((second, [0] * self._num_bins))
            self._expire(second)
        self._buckets[-1][1][self._bin(value)] += count

    def quantiles(self, qs: tuple[float, ...]) -> list[float | None]:
        """The values at these quantiles (0..1), None for each when nothing was observed."""
        self._expire(int(self._clock()))
        totals = [sum(column) for column in zip(*(counts for _, counts in self._buckets))]
        num = sum(totals)
        if not num:
            return [None] * len(qs)
        found, seen, index = {}, 0, 0
        for q in sorted(set(qs)):
            target = max(1, math.ceil(q * num))
            while seen + totals[index] < target:
                seen += totals[index]
                index += 1
            found[q] = self._value(index)
        return [found[q] for q in qs]

    def count(self) -> int:
        self._expire(int(self._clock()))
        return sum(sum(counts) for _, counts in self._buckets)

    def _bin(self, value: float) -> int:
        if value <= self._LOW:
            return 0
        index = math.ceil(math.log10(value / self._LOW) * self._BINS_PER_DECADE)
        return min(index, self._num_bins - 1)

    def _value(self, index: int) -> float:
        """A bin's midpoint (geometric) as its value; bin 0 is everything up to _LOW."""
        if index == 0:
            return self._LOW
        return self._LOW * 10 ** ((index - 0.5) / self._BINS_PER_DECADE)

    def _expire(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - self.window_s:
            self._buckets.popleft()


class RecentActivity:
    """The sliding windows of one server: token rates, request completions, latencies."""

    def __init__(self) -> None:
        self.prompt_tokens = WindowedCounter()
        self.generation_tokens = WindowedCounter()
        self.finished = WindowedCounter()
        self.ttft = WindowedQuantiles()
        self.itl = WindowedQuantiles()
        self.e2e = WindowedQuantiles()


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
        self.recent = RecentActivity()
        self.ttft_stages = TtftBreakdown(self.registry, model_name, WindowedQuantiles)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple):
        return Histogram(name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def samples(self) -> dict[str, float]:
        """Every sample /metrics would show now, by name and labels other than model_name
        (e.g. 'tllm:request_success_total{finished_reason="stop"}')."""
        values = {}
        for metric in self.registry.collect():
            for sample in metric.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                                  if k != "model_name")
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values

    def track(self, prompt_lengths: list[int], num_samples: int,
              arrival: float | None = None, submitted: float | None = None) -> RequestTracker:
        """Start tracking an API request: each prompt runs num_samples sequences (`arrival`:
        its handler began; `submitted`: it was handed to the engine)."""
        for length in prompt_lengths:
            self.prompt_tokens.inc(length)
            self.request_prompt_tokens.observe(length)
        self.recent.prompt_tokens.add(sum(prompt_lengths))
        tracker = RequestTracker(self, len(prompt_lengths) * num_samples,
                                 arrival if arrival is not None else time.monotonic())
        tracker.times.submitted = submitted
        return tracker

    def count_pooled(self, prompt_lengths: list[int], arrival: float) -> None:
        """A pooling request whose inputs all finished: each a success ("stop") with its
        prompt tokens, and the request's latency (nothing is generated: no TTFT, no ITL)."""
        for length in prompt_lengths:
            self.prompt_tokens.inc(length)
            self.request_prompt_tokens.observe(length)
        self.request_success["stop"].inc(len(prompt_lengths))
        self.recent.prompt_tokens.add(sum(prompt_lengths))
        self.recent.finished.add(len(prompt_lengths))
        latency = time.monotonic() - arrival
        self.e2e.observe(latency)
        self.recent.e2e.observe(latency)

    def count_pooling_aborted(self, num_inputs: int) -> None:
        """A pooling request ended by its client or a dead engine."""
        self.request_success["abort"].inc(num_inputs)


class RequestTracker:
    """Timings and counts of one API request's sequences. A sequence that never reports its
    finish (the client went away, or the request failed) counts as aborted on close()."""

    def __init__(self, metrics: ServerMetrics, num_seqs: int, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self.times = ServerTimes(arrival)
        self._is_first_token = True
        self._has_stages = False
        self._last_token_time: list[float | None] = [None] * num_seqs
        self._num_tokens = [0] * num_seqs
        self._unfinished = set(range(num_seqs))

    def on_tokens(self, seq: int, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.monotonic()
        last = self._last_token_time[seq]
        metrics, recent = self._metrics, self._metrics.recent
        if self._is_first_token:
            self.times.first_token = now
            metrics.ttft.observe(now - self._arrival)
            recent.ttft.observe(now - self._arrival)
            self._is_first_token = False
        if last is not None:
            itl = (now - last) / num_tokens
            for _ in range(num_tokens):
                metrics.itl.observe(itl)
            recent.itl.observe(itl, num_tokens)
        self._last_token_time[seq] = now
        self._num_tokens[seq] += num_tokens
        metrics.generation_tokens.inc(num_tokens)
        recent.generation_tokens.add(num_tokens)

    def on_finish(self, seq: int, reason: str | None) -> None:
        if seq not in self._unfinished:
            return
        self._unfinished.discard(seq)
        metrics = self._metrics
        metrics.request_success[reason if reason in FINISH_REASONS else "abort"].inc()
        metrics.request_generation_tokens.observe(self._num_tokens[seq])
        metrics.recent.finished.add(1)
        if not self._unfinished:
            metrics.e2e.observe(time.monotonic() - self._arrival)
            metrics.recent.e2e.observe(time.monotonic() - self._arrival)

    def on_engine_metrics(self, engine_metrics: dict[str, float]) -> None:
        if "queue_s" in engine_metrics:
            self._metrics.queue_time.observe(engine_metrics["queue_s"])
        if not self._has_stages:    # once per API request: its first prompt's times
            self._has_stages = True
            self._metrics.ttft_stages.observe(self.times, engine_metrics)

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
        capacity = GaugeMetricFamily("tllm:kv_cache_capacity_tokens", "Tokens the KV cache "
                                     "holds, by its storage dtype.",
                                     labels=["model_name", "kv_cache_dtype"])
        capacity.add_metric(self._model + [str(stats.get("kv_cache_dtype", "unknown"))],
                            stats.get("kv_capacity_tokens", 0))
        yield capacity
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
                 "Blocks brought back from the host or disk tier."),
                ("tllm:spec_decode_num_draft_tokens", "spec_draft_tokens",
                 "Speculative draft tokens verified by the target."),
                ("tllm:spec_decode_num_accepted_tokens", "spec_accepted_tokens",
                 "Speculative draft tokens accepted."),
                ("tllm:spec_decode_num_verify_steps", "spec_verify_steps",
                 "Request steps that verified drafts.")):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(self._model, stats.get(key, 0))
            yield counter
        if "moe_load_balancedness" in stats:
            yield self._gauge("tllm:moe_load_balancedness", "Mean over MoE layers of mean / "
                              "max tokens routed per expert (1: even; moe_load_stats).",
                              stats["moe_load_balancedness"])
        if "spec_draft_tokens" in stats:
            yield self._gauge("tllm:spec_decode_acceptance_rate", "Accepted / drafted "
                              "tokens.", stats["spec_acceptance_rate"])
            yield self._gauge("tllm:spec_decode_mean_accepted_length", "Tokens a verify "
                              "step gains (accepted drafts + 1).",
                              stats["spec_mean_accepted_length"])

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
        gauge.add_metric(self._model, value)
        return gauge
