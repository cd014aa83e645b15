"""The server's TTFT breakdown: five stages that add up to the server-side TTFT, as
Prometheus histograms on /metrics, and `tllm bench serve`'s percentiles from two scrapes."""
from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tllm.bench.serve_breakdown import parse_stages, quantile, stage_percentiles
from tllm.serve.http.metrics import WindowedQuantiles
from tllm.serve.http.ttft_breakdown import STAGES, ServerTimes, TtftBreakdown, stage_seconds

ENGINE = {"arrival_time": 10.004, "first_scheduled_time": 10.010,
          "first_token_time": 10.050}


def test_stages_add_up_to_the_server_ttft():
    server = ServerTimes(arrival=10.0, submitted=10.001, first_token=10.053)
    stages = stage_seconds(server, ENGINE)
    assert list(stages) == list(STAGES)
    assert stages["handoff"] == pytest.approx(0.003)
    assert stages["prefill"] == pytest.approx(0.040)
    assert sum(stages.values()) == pytest.approx(server.first_token - server.arrival)
    assert stage_seconds(ServerTimes(arrival=10.0, submitted=10.001), ENGINE) is None
    assert stage_seconds(server, {"arrival_time": 10.004}) is None


def test_bench_percentiles_come_from_the_difference_of_two_scrapes():
    registry = CollectorRegistry()
    breakdown = TtftBreakdown(registry, "m", WindowedQuantiles)
    early = ServerTimes(arrival=10.0, submitted=10.001, first_token=12.0)
    breakdown.observe(early, ENGINE)           # before the run: a slow one, left out
    before = parse_stages(generate_latest(registry).decode())
    for i in range(100):
        server = ServerTimes(arrival=10.0, submitted=10.001, first_token=10.051 + i * 1e-4)
        breakdown.observe(server, ENGINE)
    stages = stage_percentiles(before, parse_stages(generate_latest(registry).decode()),
                               [50, 99])
    assert stages["queue"]["count"] == 100
    assert 5 <= stages["queue"]["p50_ms"] <= 7.5     # 6 ms, within its bucket
    assert 0.5 <= stages["return"]["p99_ms"] <= 20    # the 2 s one was before the run
    assert breakdown.percentiles()["prefill"][0] == pytest.approx(0.040, rel=0.05)
    assert math.isnan(quantile([(1.0, 0), (math.inf, 0)], 0.5))


def test_a_served_request_reports_every_stage(server, http):
    before = parse_stages(http.get("/metrics").text)
    with http.stream("POST", "/v1/completions", json={
            "prompt": "Hello", "max_tokens": 3, "stream": True}) as response:
        assert response.status_code == 200
        assert "data: [DONE]" in list(response.iter_lines())
    after = parse_stages(http.get("/metrics").text)
    stages = stage_percentiles(before, after, [50])
    assert all(stages[stage]["count"] == 1 for stage in STAGES), stages
