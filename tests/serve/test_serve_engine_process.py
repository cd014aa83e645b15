"""The server over ProcessLLM (the engine in a process of its own, `tllm serve`'s default):
the same greedy answers as over the in-process LLM, refused prompts are 400s, a client that
leaves frees its KV blocks, and an engine process that dies turns into 503s."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.serve.conftest import LLM_KWARGS, MODEL
from tests.serve.helpers import assert_openai_error, wait_until_idle
from tllm import KvCacheConfig
from tllm.llmapi.process_llm import ProcessLLM
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def process_llm():
    llm = ProcessLLM(MODEL, **LLM_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def remote(process_llm):
    with ServerThread(build_app(process_llm, ServerConfig(model=MODEL))) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["The capital of France is", "1, 2, 3,"], "max_tokens": 12,
                         "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}],
                              "max_tokens": 12}),
])
def test_same_answers_as_the_in_process_engine(remote, http, path, body):
    body = {"model": MODEL, "temperature": 0, **body}
    theirs, ours = remote.post(path, json=body), http.post(path, json=body)
    assert theirs.status_code == ours.status_code == 200, theirs.text
    for remote_choice, local_choice in zip(theirs.json()["choices"], ours.json()["choices"]):
        for key in ("text", "message", "logprobs", "finish_reason"):
            assert remote_choice.get(key) == local_choice.get(key)


def test_streams_and_refusals(remote, process_llm):
    chunks = []
    with remote.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "stream": True,
            "ignore_eos": True}) as response:
        chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    # streamed in pieces (a piece may carry two steps' tokens when the client reads slower
    # than the engine steps: deltas are built off the loop thread and coalesce)
    assert len(chunks) >= 3
    error = assert_openai_error(remote.post("/v1/completions", json={
        "model": MODEL, "prompt": [1, 10_000_000], "max_tokens": 2}), 400)
    assert error["param"] == "prompt"
    wait_until_idle(process_llm)


def test_a_client_that_leaves_frees_its_blocks(remote, process_llm):
    async def give_up() -> None:
        async with httpx.AsyncClient(base_url=str(remote.base_url), timeout=0.5) as client:
            with pytest.raises(httpx.TimeoutException):
                await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "Tell a long story", "max_tokens": 400,
                    "ignore_eos": True})

    asyncio.run(give_up())
    wait_until_idle(process_llm)


def test_a_dead_engine_process_gives_503():
    llm = ProcessLLM("dummy:smollm2-135m", max_seq_len=64,
                     kv_cache_config=KvCacheConfig(max_tokens=1024))
    try:
        with ServerThread(build_app(llm, ServerConfig(model="m"))) as server, \
                httpx.Client(base_url=server.base_url, timeout=30) as client:
            assert client.get("/health").status_code == 200
            os.kill(llm.pid, signal.SIGKILL)
            time.sleep(0.2)
            assert_openai_error(client.get("/health"), 503)
            assert_openai_error(client.post("/v1/completions", json={
                "prompt": [1, 2], "max_tokens": 2}), 503)
    finally:
        llm.shutdown()


def test_the_tokenizer_is_the_engines(process_llm, smollm2):
    """Sent over pickled in the engine's "ready", it encodes and applies the chat template
    as the tokenizer loaded here does."""
    mine, theirs = smollm2.tokenizer, process_llm.tokenizer
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour, café ✓"}]
    assert theirs.encode_chat(messages) == mine.encode_chat(messages)
    assert theirs.encode("日本の首都は") == mine.encode("日本の首都は")
    assert theirs.eos_token_ids == mine.eos_token_ids and theirs.has_chat_template
