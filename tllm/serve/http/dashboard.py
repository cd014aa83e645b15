"""GET /dashboard: a live page of the server (static HTML and JS shipped in the package, no
build step, nothing from a CDN), and GET /dashboard/stats.json, the numbers it polls. The
numbers are those of /metrics (the same registry, read in one pass) plus the sliding windows
of ServerMetrics for recent rates and latency percentiles.

With --api-key, a browser opens /dashboard?api_key=KEY once: the server answers with a
session cookie (a random token it keeps, HttpOnly, SameSite=Strict, expiring; never the key)
and a redirect to /dashboard, so the key leaves the address bar and history; the page's own
requests then carry the cookie."""
from __future__ import annotations

import functools
import time
from importlib import resources
from typing import Optional

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from tllm.serve.http.auth import Grant, SessionStore, key_matches
from tllm.serve.http.errors import error_responses
from tllm.serve.http.metrics import LATENCY_WINDOW_S, RATE_WINDOW_S, WindowedQuantiles

SESSION_COOKIE = "tllm_dashboard_session"
QUANTILES = (0.5, 0.9, 0.99)
_FINISH_PREFIX = 'tllm:request_success_total{finished_reason="'


class LatencyStats(BaseModel):
    """Percentiles (seconds) of the observations of the latency window; None when none."""

    p50: Optional[float] = None
    p90: Optional[float] = None
    p99: Optional[float] = None
    count: int = 0


class DashboardStats(BaseModel):
    """One snapshot of the server and its engine."""

    model: str
    uptime_s: float
    healthy: bool
    health: str
    num_running: int
    num_waiting: int
    batch_size: int
    kv_cache_usage: float
    kv_cache_blocks_total: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    requests_per_s: float
    ttft: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished: dict[str, int]
    rate_window_s: int = RATE_WINDOW_S
    latency_window_s: int = LATENCY_WINDOW_S


def dashboard_grant(api_key: str | None, sessions: SessionStore) -> Grant:
    """Besides the Authorization header, /dashboard* takes a live session's cookie, and the
    page itself ?api_key=KEY (which the page trades for a session)."""
    def allows(request: Request) -> bool:
        if sessions.is_valid(request.cookies.get(SESSION_COOKIE)):
            return True
        return (api_key is not None and request.url.path == "/dashboard"
                and key_matches(request.query_params.get("api_key"), api_key))
    return Grant("/dashboard", allows, hint="or open /dashboard?api_key=<key> in a browser")


def dashboard_routes(ctx, sessions: SessionStore) -> APIRouter:
    """The page and its JSON (behind the API key: auth.ApiKeyGuard and dashboard_grant)."""
    router = APIRouter(responses=error_responses(401, 500))
    started = time.monotonic()
    api_key = ctx.config.api_key

    @router.get("/dashboard", include_in_schema=False)
    async def page(request: Request) -> Response:
        if "api_key" not in request.query_params:
            return HTMLResponse(_page_html())
        # the address without the key; a session instead when it is the key
        response = RedirectResponse(request.url.path, status_code=303,
                                    headers={"Cache-Control": "no-store",
                                             "Referrer-Policy": "no-referrer"})
        if api_key is not None and key_matches(request.query_params["api_key"], api_key):
            response.set_cookie(SESSION_COOKIE, sessions.create(), max_age=int(sessions.ttl_s),
                                path="/dashboard", httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
        return response

    @router.get("/dashboard/stats.json", summary="The dashboard's numbers",
                responses={200: {"model": DashboardStats}})
    async def stats() -> Response:
        return JSONResponse(snapshot(ctx, time.monotonic() - started).model_dump())

    return router


def snapshot(ctx, uptime_s: float) -> DashboardStats:
    """The numbers now: /metrics' samples, the engine's health, the sliding windows."""
    samples = ctx.metrics.samples()
    recent = ctx.metrics.recent
    reason = ctx.engine.health()
    running = int(samples.get("tllm:num_requests_running", 0))
    finished = {key[len(_FINISH_PREFIX):-2]: int(value) for key, value in samples.items()
                if key.startswith(_FINISH_PREFIX)}
    return DashboardStats(
        model=ctx.config.model_name, uptime_s=uptime_s, healthy=reason is None,
        health=reason or "ok", num_running=running,
        num_waiting=int(samples.get("tllm:num_requests_waiting", 0)), batch_size=running,
        kv_cache_usage=samples.get("tllm:kv_cache_usage_perc", 0.0),
        kv_cache_blocks_total=int(samples.get("tllm:kv_cache_blocks_total", 0)),
        prefix_cache_hit_rate=samples.get("tllm:prefix_cache_hit_rate", 0.0),
        num_preemptions=int(samples.get("tllm:num_preemptions_total", 0)),
        prompt_tokens_per_s=recent.prompt_tokens.rate(),
        generation_tokens_per_s=recent.generation_tokens.rate(),
        requests_per_s=recent.finished.rate(),
        ttft=_latency(recent.ttft), itl=_latency(recent.itl), e2e=_latency(recent.e2e),
        prompt_tokens_total=int(samples.get("tllm:prompt_tokens_total", 0)),
        generation_tokens_total=int(samples.get("tllm:generation_tokens_total", 0)),
        requests_finished=finished)


def _latency(window: WindowedQuantiles) -> LatencyStats:
    p50, p90, p99 = window.quantiles(QUANTILES)
    return LatencyStats(p50=p50, p90=p90, p99=p99, count=window.count())


@functools.cache
def _page_html() -> str:
    return resources.files("tllm.serve.http").joinpath("static/dashboard.html").read_text()
