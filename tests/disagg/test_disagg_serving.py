"""`tllm serve disaggregated` end to end: a context and a generation server, each a real
process (`tllm serve MODEL --role ...`), behind the front (in this process). The generation
server answers requests without disaggregated_params whole, so its own answer is the
aggregated reference."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.disagg.conftest import disagg_specs, start_servers, wait_all_free
from tllm.serve.fronts.disagg_front import DisaggFront, DisaggFrontConfig, build_front_app
from tllm.serve.testing import ServerThread

GREEDY = {"temperature": 0, "ignore_eos": True}
# two server processes (and their engine processes) to start: about 45 s on two cores
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp_path_factory):
    secret_file = tmp_path_factory.mktemp("disagg") / "kv-secret"
    secret_file.write_text("serving-test-secret\n")
    context, generation = start_servers(*disagg_specs(
        tiny_model_dir, "--kv-hold-timeout", "5", secret_file=str(secret_file)))
    yield context, generation
    for server in (context, generation):
        server.stop()


@pytest.fixture(scope="module")
def front(workers):
    context, generation = workers
    config = DisaggFrontConfig(context_servers={"num_instances": 1, "urls": [context.url]},
                               generation_servers={"urls": [generation.url]})
    with ServerThread(build_front_app(DisaggFront(config))) as server:
        yield server


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _stream_text(url: str, path: str, body: dict) -> tuple[str, list[dict]]:
    chunks = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    key = "text" if path.endswith("/completions") and "chat" not in path else None
    text = "".join((c["choices"][0]["text"] if key else c["choices"][0]["delta"].get("content")
                    or "") for c in chunks if c["choices"])
    return text, chunks


@pytest.mark.parametrize("prompt", ["the quick brown fox", "hello world, " * 12])
def test_completion_identical_to_aggregated(workers, front, prompt):
    _, generation = workers
    body = {"prompt": prompt, "max_tokens": 24, "logprobs": 2, **GREEDY}
    ours = _post(front.base_url, "/v1/completions", body).json()
    reference = _post(generation.url, "/v1/completions", body).json()
    assert ours["choices"][0]["text"] == reference["choices"][0]["text"]
    assert ours["choices"][0]["logprobs"]["tokens"] == reference["choices"][0]["logprobs"]["tokens"]
    assert ours["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        reference["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    assert ours["usage"] == reference["usage"]
    stats = generation.stats()
    assert stats["disagg_num_imported"] >= 1 and stats["disagg_num_failed"] == 0


def test_streaming_chat_stop_string_and_usage(workers, front):
    _, generation = workers
    body = {"messages": [{"role": "user", "content": "the lazy dog"}], "max_tokens": 30,
            **GREEDY}
    reference = _post(generation.url, "/v1/chat/completions", body).json()
    assert "choices" in reference, reference
    full = reference["choices"][0]["message"]["content"]
    stop = full[8:11]   # a stop string the greedy answer reaches
    text, chunks = _stream_text(front.base_url, "/v1/chat/completions", {
        **body, "stop": [stop], "stream_options": {"include_usage": True}})
    expected = _post(generation.url, "/v1/chat/completions", {**body, "stop": [stop]}).json()
    assert text == expected["choices"][0]["message"]["content"] == full[:full.index(stop)]
    assert chunks[-1]["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "stop"


def test_n_samples_and_seeded_sampling_match(workers, front):
    _, generation = workers
    body = {"prompt": "jumps over", "max_tokens": 12, "n": 2, "seed": 7, "temperature": 0.8,
            "ignore_eos": True}
    ours = _post(front.base_url, "/v1/completions", body).json()
    reference = _post(generation.url, "/v1/completions", body).json()
    assert [c["text"] for c in ours["choices"]] == [c["text"] for c in reference["choices"]]


def test_bad_request_is_the_workers_400(front):
    response = _post(front.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 4,
                                                          "temperature": -1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"
    # A request without a prompt: the worker's 400 relayed (unknown fields are ignored now).
    assert _post(front.base_url, "/v1/completions", {"max_tokens": 4}).status_code == 400


def test_disconnecting_clients_leave_no_blocks(workers, front):
    context, generation = workers

    async def leave_mid_stream(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"client {i} says hello world", "max_tokens": 200, "stream": True,
                **GREEDY}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break   # one token in, then gone

    async def run() -> None:
        async with httpx.AsyncClient(base_url=front.base_url, timeout=60) as client:
            await asyncio.gather(*(leave_mid_stream(client, i) for i in range(30)))

    asyncio.run(run())
    for server in (context, generation):
        wait_all_free(server, timeout_s=15)
    assert context.stats()["disagg_num_fetched"] >= 30


def test_unfetched_blocks_expire(workers):
    """A prefill whose generation side never comes frees its blocks after the timeout."""
    context, _ = workers
    body = {"prompt": "never fetched " * 4, "max_tokens": 1,
            "disaggregated_params": {"request_type": "context_only", "ctx_request_id": "lost"}}
    assert _post(context.url, "/v1/completions", body).status_code == 200
    assert context.stats()["disagg_requests_held"] == 1
    stats = wait_all_free(context, timeout_s=10)
    assert stats["disagg_num_expired"] >= 1


def test_killed_generation_server_gives_503_quickly(workers, front):
    """(Last: it kills the generation server.)"""
    context, generation = workers
    generation.kill()
    started = time.monotonic()
    response = _post(front.base_url, "/v1/completions", {"prompt": "anyone?", "max_tokens": 4})
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert time.monotonic() - started < 5
    assert httpx.get(front.base_url + "/health", timeout=10).status_code == 503
    wait_all_free(context, timeout_s=10)   # the prefill it did for nothing expires
