"""A burst above capacity with a small --max-queue-size: some requests get 429 with
Retry-After, and every accepted request still completes."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.serve.conftest import MODEL
from tests.serve.helpers import assert_openai_error, wait_until_idle
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

pytestmark = pytest.mark.slow
BURST = 40


async def burst(base_url: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=BURST)) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json={
            "model": MODEL, "prompt": f"Request {i}:", "max_tokens": 4, "ignore_eos": True})
            for i in range(BURST)))


def test_burst_over_a_small_queue_gets_429s(smollm2):
    wait_until_idle(smollm2)
    config = ServerConfig(model=MODEL, max_queue_size=2)
    with ServerThread(build_app(smollm2, config)) as server:
        responses = asyncio.run(burst(server.base_url))
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert accepted and refused
    for response in refused:
        error = assert_openai_error(response, 429)
        assert error["code"] == "queue_full"
        assert int(response.headers["retry-after"]) >= 1
    for response in accepted:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert response.json()["usage"]["completion_tokens"] == 4
    wait_until_idle(smollm2)
