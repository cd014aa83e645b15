"""Clients that give up: 100 concurrent streams dropped after 0.5 s are all aborted in the
engine, every KV block is free again within a second, and the next request completes."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import MODEL
from tests.serve.helpers import wait_until_idle

pytestmark = pytest.mark.slow
NUM_STREAMS = 100
GIVE_UP_AFTER_S = 0.5


def wait_for_aborted(http: httpx.Client, count: float, timeout_s: float = 1.0) -> None:
    """The abort counter reaches count (metrics settle just after the engine's aborts)."""
    deadline = time.monotonic() + timeout_s
    while aborted_count(http) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert aborted_count(http) == count


def aborted_count(http: httpx.Client) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if (sample.name == "tllm:request_success_total"
                    and sample.labels["finished_reason"] == "abort"):
                return sample.value
    raise AssertionError("no abort counter in /metrics")


async def give_up_on_stream(client: httpx.AsyncClient, i: int, path: str, body: dict) -> int:
    """Stream a long answer and hang up after GIVE_UP_AFTER_S; returns the bytes read."""
    num_bytes = 0
    try:
        async with asyncio.timeout(GIVE_UP_AFTER_S):
            async with client.stream("POST", path, json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for chunk in response.aiter_bytes():
                    num_bytes += len(chunk)
    except TimeoutError:
        return num_bytes
    raise AssertionError(f"stream {i} finished before the client gave up")


async def give_up_on_all(base_url: str) -> list[int]:
    limits = httpx.Limits(max_connections=NUM_STREAMS)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30) as client:
        tasks = []
        for i in range(NUM_STREAMS):
            completion = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 400,
                          "stream": True, "ignore_eos": True}
            chat = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}"}],
                    "max_tokens": 400, "stream": True, "ignore_eos": True}
            path, body = (("/v1/completions", completion) if i % 2 else
                          ("/v1/chat/completions", chat))
            tasks.append(give_up_on_stream(client, i, path, body))
        return await asyncio.gather(*tasks)


def test_streams_that_give_up_are_aborted_and_free_their_blocks(server, http, smollm2):
    wait_until_idle(smollm2)
    aborted_before = aborted_count(http)
    num_bytes = asyncio.run(give_up_on_all(server.base_url))
    seconds = wait_until_idle(smollm2, timeout_s=1.0)
    assert sum(1 for n in num_bytes if n > 0) >= 8  # the running batch did stream
    wait_for_aborted(http, aborted_before + NUM_STREAMS)
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello",
                                                  "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    print(f"engine idle {seconds:.3f} s after the clients gave up")


def test_non_streaming_clients_that_give_up_are_aborted(server, http, smollm2):
    async def give_up(client: httpx.AsyncClient, i: int) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json={
                "model": MODEL, "prompt": f"Essay {i}:", "max_tokens": 400, "ignore_eos": True},
                timeout=GIVE_UP_AFTER_S)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url) as client:
            await asyncio.gather(*(give_up(client, i) for i in range(10)))

    aborted_before = aborted_count(http)
    asyncio.run(main())
    wait_until_idle(smollm2, timeout_s=1.0)
    wait_for_aborted(http, aborted_before + 10)
