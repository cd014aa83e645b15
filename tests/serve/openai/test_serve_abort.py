"""Clients that give up: 100 concurrent streams dropped after 0.5 s (and once the running
batch has streamed) are all aborted in the engine, every KV block is free again once the
step in flight has run, and the next request completes.

What is asserted is counted in engine steps, not seconds: aborts land between steps, so at
most the step in flight (and, under the overlap scheduler, the one already launched) runs
after the last hang-up. Its time is the machine's: 0.07-0.3 s on a Sapphire Rapids VM,
~1.3 s on the AVX2-only VMs CI runs on, where one 64-token step of SmolLM2 takes ~0.8 s;
the seconds are printed."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import LLM_KWARGS, MODEL
from tests.serve.helpers import wait_until_idle

pytestmark = pytest.mark.slow
NUM_STREAMS = 100
GIVE_UP_AFTER_S = 0.5
MAX_STEPS_AFTER_HANG_UP = 2   # the step in flight, and the one the overlap scheduler launched


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


async def give_up_on_stream(client: httpx.AsyncClient, i: int, path: str, body: dict,
                            received: list[int], hang_up: asyncio.Event) -> None:
    """Stream a long answer, counting its bytes in received[i], until `hang_up` is set."""
    async def read() -> None:
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for chunk in response.aiter_bytes():
                received[i] += len(chunk)
        raise AssertionError(f"stream {i} finished before the client gave up")

    reader = asyncio.create_task(read())
    await asyncio.wait([reader, asyncio.create_task(hang_up.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if reader.done():
        reader.result()   # raises what ended the stream early
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)


async def give_up_on_all(base_url: str, llm) -> tuple[list[int], int]:
    """Open NUM_STREAMS streams; hang up on all once GIVE_UP_AFTER_S has passed and the
    running batch has streamed (on a slow machine its first steps end later than that);
    returns each stream's bytes and the engine's step count at the hang-up."""
    batch_size = LLM_KWARGS["max_batch_size"]
    limits = httpx.Limits(max_connections=NUM_STREAMS)
    received, hang_up = [0] * NUM_STREAMS, asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30) as client:
        tasks = []
        for i in range(NUM_STREAMS):
            completion = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 400,
                          "stream": True, "ignore_eos": True}
            chat = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}"}],
                    "max_tokens": 400, "stream": True, "ignore_eos": True}
            path, body = (("/v1/completions", completion) if i % 2 else
                          ("/v1/chat/completions", chat))
            tasks.append(asyncio.create_task(
                give_up_on_stream(client, i, path, body, received, hang_up)))
        await asyncio.sleep(GIVE_UP_AFTER_S)
        deadline = time.monotonic() + 30
        while (sum(1 for n in received if n > 0) < batch_size and time.monotonic() < deadline
               and not any(t.done() for t in tasks)):
            await asyncio.sleep(0.01)
        hang_up_steps = llm.get_stats()["num_steps"]
        hang_up.set()
        await asyncio.gather(*tasks)
    return received, hang_up_steps


def steps_after(llm, hang_up_steps: int) -> int:
    return llm.get_stats()["num_steps"] - hang_up_steps


def test_streams_that_give_up_are_aborted_and_free_their_blocks(server, http, smollm2):
    wait_until_idle(smollm2)
    aborted_before = aborted_count(http)
    num_bytes, hang_up_steps = asyncio.run(give_up_on_all(server.base_url, smollm2))
    seconds = wait_until_idle(smollm2, timeout_s=30)
    assert sum(1 for n in num_bytes if n > 0) >= 8  # the running batch did stream
    assert steps_after(smollm2, hang_up_steps) <= MAX_STEPS_AFTER_HANG_UP
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
    hang_up_steps = smollm2.get_stats()["num_steps"]
    wait_until_idle(smollm2, timeout_s=30)
    assert steps_after(smollm2, hang_up_steps) <= MAX_STEPS_AFTER_HANG_UP
    wait_for_aborted(http, aborted_before + 10)
