"""Issue 14, finding 9: 200 streams dropped by their clients after 0.5 s (and once the engine
runs some of them: on a loaded machine its first step can start later) are all aborted, and
every KV block is free, once the step in flight has run, over the engine process (`tllm
serve`'s default) and in the server's process: a disconnect is seen within ~20 ms, the
aborts of one event-loop turn cross the pipe as one message, and the loop applies them as
soon as the step in flight has run (before sampling it).

What is asserted is counted in steps from the moment the last client's socket is closed (the
client's teardown is not the server's latency): a few steps, where the 200 streams would
need thousands to finish their 400 tokens at batch 8; the seconds are the machine's and are
printed. Issue 14's goal is 1 s. Measured on a 2-core Sapphire Rapids VM, 2026-12-01, three
runs each: 0.07-0.29 s (engine process), 0.07-0.32 s (in process). On the 2-core AVX2-only
VMs CI runs on (2026-12-05) one 64-token step of SmolLM2 takes ~0.8 s, and the same check
measured 1.35 s: the time is one step's, which the step budget here (batch 8, 64 tokens)
keeps short. Once (CI, 2026-12-06) 4 steps ran, 6.2 s, counted from before the client's
teardown: there the engine process, the server thread, the client and another test worker
share 2 cores, so the disconnects reach the server late; the bound allows for that."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.serve.conftest import LLM_KWARGS, MODEL
from tests.serve.helpers import wait_until_idle
from tests.serve.openai.test_serve_abort import aborted_count, wait_for_aborted
from tllm.llmapi.process_llm import ProcessLLM
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

pytestmark = pytest.mark.slow
NUM_STREAMS = 200
GIVE_UP_AFTER_S = 0.5
# The step in flight and the one the overlap scheduler launched, and a few more where the
# server's thread waits for a core (and the GIL) on a starved machine.
MAX_STEPS_AFTER_HANG_UP = 6
# ... or, where steps are short, this many seconds: over the engine process the 200 aborts
# cross a pipe and the step count read at the hang-up may be a heartbeat (0.1 s) old, so a
# fast CPU runs several short steps before the last abort lands (9 in 0.23 s, once).
MAX_SECONDS_AFTER_HANG_UP = 1.0


async def give_up_on_all(llm, base_url: str) -> tuple[float, int]:
    """Open NUM_STREAMS long streams (completions and chat); hang up on all of them once
    GIVE_UP_AFTER_S has passed and the engine is running some (on a loaded machine the first
    step can start later than that); returns the time of the last hang-up and the engine's
    step count then."""
    async def stream(client: httpx.AsyncClient, i: int) -> None:
        if i % 2:
            path, body = "/v1/completions", {"prompt": f"Story number {i}:"}
        else:
            path, body = "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"Count to {i}"}]}
        body = {"model": MODEL, **body, "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for _ in response.aiter_bytes():
                pass
        raise AssertionError(f"stream {i} finished before its client gave up")

    limits = httpx.Limits(max_connections=NUM_STREAMS)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=30) as client:
        tasks = [asyncio.create_task(stream(client, i)) for i in range(NUM_STREAMS)]
        await asyncio.sleep(GIVE_UP_AFTER_S)
        deadline = time.monotonic() + 20
        while llm.get_stats()["num_running"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert llm.get_stats()["num_running"] > 0, "no stream's request ever ran"
        for task in tasks:
            assert not task.done(), task.exception()
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # every socket is closed now: the client's async exit closed the pool
    return time.monotonic(), llm.get_stats()["num_steps"]


def check_aborts_within_deadline(llm, base_url: str) -> float:
    with httpx.Client(base_url=base_url, timeout=30) as http:
        wait_until_idle(llm, timeout_s=10)
        aborted_before = aborted_count(http)
        steps_before = llm.get_stats()["num_steps"]
        last_hang_up, hang_up_steps = asyncio.run(give_up_on_all(llm, base_url))
        wait_until_idle(llm, timeout_s=30)
        seconds = time.monotonic() - last_hang_up
        steps = llm.get_stats()["num_steps"]
        print(f"{NUM_STREAMS} streams: engine idle, every block free, {seconds:.3f} s after "
              f"the last client hung up; {steps - steps_before} steps ran on them, "
              f"{steps - hang_up_steps} after it")
        assert steps > steps_before
        assert (steps - hang_up_steps <= MAX_STEPS_AFTER_HANG_UP
                or seconds <= MAX_SECONDS_AFTER_HANG_UP), (steps - hang_up_steps, seconds)
        wait_for_aborted(http, aborted_before + NUM_STREAMS)
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello",
                                                      "max_tokens": 4, "ignore_eos": True})
        assert response.json()["usage"]["completion_tokens"] == 4
    return seconds


def test_200_dropped_streams_over_the_engine_process():
    with ProcessLLM(MODEL, **LLM_KWARGS) as llm, \
            ServerThread(build_app(llm, ServerConfig(model=MODEL, max_queue_size=None))) as server:
        check_aborts_within_deadline(llm, server.base_url)


def test_200_dropped_streams_in_process(smollm2):
    with ServerThread(build_app(smollm2, ServerConfig(model=MODEL,
                                                      max_queue_size=None))) as server:
        check_aborts_within_deadline(smollm2, server.base_url)
