"""The serving benchmark's load generator: random prompts of token ids sent to an
OpenAI-compatible /v1/completions endpoint as streams, at a fixed Poisson rate (or all at
once), with a cap on requests in flight; it records when every chunk of every answer arrived."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0      # lengths drawn from [len * (1 - r), len * (1 + r)]
    vocab_size: int = 10000       # prompt token ids are drawn from [0, vocab_size)
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    """One request's outcome; times are seconds since the benchmark started."""

    start: float
    num_prompt_tokens: int
    is_ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    num_output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)


@dataclass
class BenchRun:
    config: BenchConfig
    model: str
    results: list[RequestResult]
    duration_s: float


def random_requests(config: BenchConfig) -> list[BenchRequest]:
    """num_prompts prompts of random token ids; lengths vary by range_ratio around the
    configured ones (exactly those when it is 0)."""
    rng = random.Random(config.seed)

    def length(target: int) -> int:
        spread = int(target * config.range_ratio)
        return max(1, rng.randint(target - spread, target + spread))

    return [BenchRequest([rng.randrange(config.vocab_size) for _ in range(length(
        config.input_len))], length(config.output_len)) for _ in range(config.num_prompts)]


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from the start): all 0 at an infinite rate, else a Poisson process."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def run_benchmark(config: BenchConfig) -> BenchRun:
    """Check the endpoint with one short request, then run the timed load."""
    requests = random_requests(config)
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
    return await run_share(config, requests, offsets, config.max_concurrency)


async def run_share(config: BenchConfig, requests: list[BenchRequest], offsets: list[float],
                    max_concurrency: int | None, ready=None) -> BenchRun:
    """Send `requests` at their offsets after one check request; `ready` (a barrier shared
    with the other load-generator processes) holds the start until all are set."""
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with httpx.AsyncClient(base_url=config.base_url.rstrip("/"), limits=limits,
                                 headers=headers, timeout=config.timeout_s) as client:
        model = config.model or await _served_model(client)
        check = await _send(client, model, BenchRequest(requests[0].prompt_token_ids, 1),
                            time.perf_counter())
        if not check.is_ok:
            raise RuntimeError(f"the test request failed: {check.error}")
        if ready is not None:
            ready.wait(timeout=config.timeout_s)
        semaphore = asyncio.Semaphore(max_concurrency or len(requests) or 1)
        start = time.perf_counter()
        results = await asyncio.gather(*(
            _send_at(client, model, request, start, offset, semaphore)
            for request, offset in zip(requests, offsets)))
        duration = time.perf_counter() - start
    return BenchRun(config, model, list(results), duration)


async def _served_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _send_at(client: httpx.AsyncClient, model: str, request: BenchRequest, start: float,
                   offset: float, semaphore: asyncio.Semaphore) -> RequestResult:
    await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
    async with semaphore:
        return await _send(client, model, request, start)


async def _send(client: httpx.AsyncClient, model: str, request: BenchRequest,
                start: float) -> RequestResult:
    body = {"model": model, "prompt": request.prompt_token_ids,
            "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    result = RequestResult(sent - start, len(request.prompt_token_ids))
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            await _read_events(response, result, start)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - sent
    if result.chunk_times:
        result.ttft = result.chunk_times[0] - (sent - start)
    result.is_ok = result.error is None
    return result


async def _read_events(response: httpx.Response, result: RequestResult, start: float) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            result.error = event["error"].get("message", "error event")
            return
        if event.get("choices"):
            result.chunk_times.append(time.perf_counter() - start)
        if event.get("usage"):
            result.num_output_tokens = event["usage"]["completion_tokens"]
