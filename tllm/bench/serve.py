"""The serving benchmark's load generator: prompts (tllm.bench.serve_datasets) sent to an
OpenAI-compatible /v1/completions or /v1/chat/completions endpoint as streams, at a fixed
Poisson rate (or all at once), with a cap on requests in flight; it records when every chunk
of every answer arrived."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from tllm.bench.serve_datasets import (DATASETS, DEFAULT_NUM_PROMPTS, DEFAULT_OUTPUT_LEN,
                                       BenchRequest, as_text, jsonl_prompts, random_prompts,
                                       sharegpt_prompts)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    num_prompts: int | None = None   # None: the dataset's default (serve_datasets)
    input_len: int = 1024
    output_len: int = DEFAULT_OUTPUT_LEN
    range_ratio: float = 0.0      # lengths drawn from [len * (1 - r), len * (1 + r)]
    vocab_size: int = 10000       # prompt token ids are drawn from [0, vocab_size)
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    endpoint: str = "completions"    # a key of ENDPOINTS
    dataset_name: str = "random"
    dataset_path: str | None = None
    fixed_output_len: int | None = None  # overrides a dataset's output lengths

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, "
                             f"got {self.endpoint!r}")
        if self.dataset_name not in DATASETS:
            raise ValueError(f"dataset_name must be one of {', '.join(DATASETS)}, "
                             f"got {self.dataset_name!r}")
        if self.dataset_name != "random" and not self.dataset_path:
            raise ValueError(f"--dataset-name {self.dataset_name} needs --dataset-path FILE")

    @property
    def needs_tokenizer(self) -> bool:
        """ShareGPT's lengths are counted in tokens; a chat message holds text, not ids."""
        return self.dataset_name == "sharegpt" or (self.dataset_name == "random"
                                                   and self.endpoint == "chat")


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
    """The random dataset of `config`: prompts of random token ids."""
    return random_prompts(config.num_prompts or DEFAULT_NUM_PROMPTS, config.input_len,
                          config.output_len, config.range_ratio, config.vocab_size,
                          config.seed)


def dataset_requests(config: BenchConfig, tokenizer=None) -> list[BenchRequest]:
    """The requests of the configured dataset (`tokenizer`: where `needs_tokenizer`)."""
    if config.dataset_name == "sharegpt":
        return sharegpt_prompts(config.dataset_path, config.num_prompts, tokenizer,
                                config.fixed_output_len, config.seed)
    if config.dataset_name == "jsonl":
        return jsonl_prompts(config.dataset_path, config.num_prompts, config.fixed_output_len)
    requests = random_requests(config)
    return as_text(requests, tokenizer) if config.endpoint == "chat" else requests


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


async def run_benchmark(config: BenchConfig, requests: list[BenchRequest] | None = None,
                        on_done: Callable[[], object] | None = None) -> BenchRun:
    """Check the endpoint with one short request, then send `requests` (default: the random
    dataset of `config`); `on_done` is called as each one ends (a progress bar's update)."""
    requests = random_requests(config) if requests is None else requests
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed)
    return await run_share(config, requests, offsets, config.max_concurrency,
                           on_done=on_done)


async def run_share(config: BenchConfig, requests: list[BenchRequest], offsets: list[float],
                    max_concurrency: int | None, ready=None,
                    on_done: Callable[[], object] | None = None) -> BenchRun:
    """Send `requests` at their offsets after one check request; `ready` (a barrier shared
    with the other load-generator processes) holds the start until all are set."""
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with httpx.AsyncClient(base_url=config.base_url.rstrip("/"), limits=limits,
                                 headers=headers, timeout=config.timeout_s) as client:
        model = config.model or await _served_model(client)
        check = await _send(client, config.endpoint, model,
                            BenchRequest(requests[0].prompt, 1), time.perf_counter())
        if not check.is_ok:
            raise RuntimeError(f"the test request failed: {check.error}")
        if ready is not None:
            ready.wait(timeout=config.timeout_s)
        semaphore = asyncio.Semaphore(max_concurrency or len(requests) or 1)
        start = time.perf_counter()
        results = await asyncio.gather(*(
            _send_at(client, config.endpoint, model, request, start, offset, semaphore,
                     on_done)
            for request, offset in zip(requests, offsets)))
        duration = time.perf_counter() - start
    return BenchRun(config, model, list(results), duration)


async def _served_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _send_at(client: httpx.AsyncClient, endpoint: str, model: str,
                   request: BenchRequest, start: float, offset: float,
                   semaphore: asyncio.Semaphore, on_done) -> RequestResult:
    await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
    async with semaphore:
        result = await _send(client, endpoint, model, request, start)
    if on_done is not None:
        on_done()
    return result


def request_body(endpoint: str, model: str, request: BenchRequest) -> dict:
    """A streamed request of exactly max_tokens output tokens (EOS ignored), greedy."""
    body = {"model": model, "max_tokens": request.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


async def _send(client: httpx.AsyncClient, endpoint: str, model: str, request: BenchRequest,
                start: float) -> RequestResult:
    body = request_body(endpoint, model, request)
    sent = time.perf_counter()
    result = RequestResult(sent - start, request.num_prompt_tokens or 0)
    try:
        async with client.stream("POST", ENDPOINTS[endpoint], json=body) as response:
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
        if event.get("choices") and not _is_role_chunk(event):
            result.chunk_times.append(time.perf_counter() - start)
        if event.get("usage"):
            result.num_output_tokens = event["usage"]["completion_tokens"]
            result.num_prompt_tokens = event["usage"].get("prompt_tokens",
                                                          result.num_prompt_tokens)


def _is_role_chunk(event: dict) -> bool:
    """A chat stream's first chunk names the role and carries no token: not timed."""
    delta = event["choices"][0].get("delta") or {}
    return bool(delta.get("role"))
