"""The server's TTFT breakdown over one benchmark run: its `tllm:ttft_stage_seconds`
histograms (tllm/serve/http/ttft_breakdown.py) scraped from /metrics before and after the run,
their difference turned into percentiles per stage (linear within a bucket, as
Prometheus' histogram_quantile). A server without them (another engine) gives None."""
from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

STAGE_METRIC = "tllm:ttft_stage_seconds"
STAGES = ("server", "handoff", "queue", "prefill", "return")

# stage -> [(upper bound in seconds, cumulative count), ...] in ascending bounds
Buckets = dict[str, list[tuple[float, float]]]


def scrape_stages(base_url: str, api_key: str | None = None) -> Buckets | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_stages(response.text)


def parse_stages(text: str) -> Buckets | None:
    buckets: Buckets = {}
    for family in text_string_to_metric_families(text):
        if family.name != STAGE_METRIC:
            continue
        for sample in family.samples:
            if sample.name == STAGE_METRIC + "_bucket":
                bound = float(sample.labels["le"])
                buckets.setdefault(sample.labels["stage"], []).append((bound, sample.value))
    for rows in buckets.values():
        rows.sort()
    return buckets or None


def quantile(rows: list[tuple[float, float]], q: float) -> float:
    """The q-quantile (0..1) of cumulative bucket counts; NaN without observations."""
    total = rows[-1][1] if rows else 0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in rows:
        if count >= rank:
            if math.isinf(bound):
                return lower      # beyond the largest finite bound: report that bound
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def stage_percentiles(before: Buckets | None, after: Buckets | None,
                      percentiles: list[float]) -> dict[str, dict[str, float]] | None:
    """Per stage: the run's observation count and its percentiles in milliseconds."""
    if after is None:
        return None
    out = {}
    for stage in STAGES:
        earlier = dict((before or {}).get(stage, []))
        rows = [(bound, count - earlier.get(bound, 0)) for bound, count in after.get(stage, [])]
        figures = {"count": rows[-1][1] if rows else 0}
        for p in percentiles:
            figures[f"p{p:g}_ms"] = quantile(rows, p / 100) * 1000
        out[stage] = figures
    return out


def format_stages(stages: dict[str, dict[str, float]], percentiles: list[float]) -> str:
    header = "".join(f"{f'p{p:g} ms':>10}" for p in percentiles)
    lines = [" Server TTFT by stage (bucketed) ".center(50, "-"),
             f"{'stage':<10}{'count':>8}{header}"]
    for stage, figures in stages.items():
        cells = "".join(f"{figures[f'p{p:g}_ms']:>10.1f}" for p in percentiles)
        lines.append(f"{stage:<10}{figures['count']:>8.0f}{cells}")
    return "\n".join(lines)
