"""What an RL trainer asks of the OpenAI routes (fake engine): tokens in logprobs as
"token_id:<id>" (vLLM's return_tokens_as_token_ids) on completions and chat, streamed or
not, and logprobs_mode passed through to the engine's SamplingParams (or a 400)."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.openai.params import sampling_params
from tllm.serve.openai.protocol import CompletionRequest
from tllm.serve.testing import FakeLLM, ServerThread

IDS = ["token_id:97", "token_id:98", "token_id:99"]   # the fake engine writes "abc"


@pytest.fixture(scope="module")
def client():
    app = build_app(FakeLLM(), ServerConfig(model="org/fake"))
    with ServerThread(app) as server, httpx.Client(base_url=server.base_url,
                                                   timeout=30) as client:
        yield client


def _completion(client, **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "org/fake", "prompt": "hi",
                                                "max_tokens": 3, "logprobs": 1, **extra})


def _chat(client, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": "org/fake", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3, "logprobs": True, "top_logprobs": 1, **extra})


def test_completions_tokens_as_ids(client):
    logprobs = _completion(client, return_tokens_as_token_ids=True).json()["choices"][0][
        "logprobs"]
    assert logprobs["tokens"] == IDS
    assert [list(top) for top in logprobs["top_logprobs"]] == [[t] for t in IDS]
    plain = _completion(client).json()["choices"][0]["logprobs"]
    assert plain["tokens"] == ["a", "b", "c"]


def test_chat_tokens_as_ids(client):
    content = _chat(client, return_tokens_as_token_ids=True).json()["choices"][0][
        "logprobs"]["content"]
    assert [c["token"] for c in content] == IDS
    assert [c["top_logprobs"][0]["token"] for c in content] == IDS
    assert [c["token"] for c in _chat(client).json()["choices"][0]["logprobs"]["content"]] \
        == ["a", "b", "c"]


def test_streamed_tokens_as_ids(client):
    for post, path in ((_completion, ("logprobs", "tokens")),
                       (_chat, ("logprobs", "content"))):
        response = post(client, return_tokens_as_token_ids=True, stream=True)
        tokens = []
        for line in response.text.splitlines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("logprobs"):
                entries = choice["logprobs"][path[1]]
                tokens += [e["token"] if isinstance(e, dict) else e for e in entries]
        assert tokens == IDS, path


def test_logprobs_mode_reaches_the_engine_and_is_checked(client):
    body = CompletionRequest(prompt="hi", logprobs_mode="processed_logprobs")
    assert sampling_params(body, 4, logprobs=1).logprobs_mode == "processed_logprobs"
    assert sampling_params(CompletionRequest(prompt="hi"), 4).logprobs_mode == "raw_logprobs"
    assert _completion(client, logprobs_mode="tempered_logprobs").status_code == 200
    error = assert_openai_error(_completion(client, logprobs_mode="raw_logits"), 400)
    assert "logprobs_mode" in (error["param"] or "") + error["message"]


def test_completions_prompt_logprobs_in_the_same_call(client):
    """vLLM's prompt_logprobs: per prompt position, the token's logprob (the fake engine's
    -1.0), keyed by token id, beside the sampled tokens' logprobs."""
    choice = _completion(client, prompt_logprobs=1).json()["choices"][0]
    prompt = choice["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == 2   # "hi": h, i
    assert prompt[1] == {"105": {"logprob": -1.0, "rank": 1, "decoded_token": "i"}}
    assert choice["logprobs"]["tokens"] == ["a", "b", "c"]
    as_ids = _completion(client, prompt_logprobs=0, return_tokens_as_token_ids=True).json()
    assert as_ids["choices"][0]["prompt_logprobs"][1]["105"]["decoded_token"] == "token_id:105"
    assert _completion(client).json()["choices"][0]["prompt_logprobs"] is None
    error = assert_openai_error(_completion(client, prompt_logprobs=1, stream=True), 400)
    assert error["param"] == "prompt_logprobs"


def test_chat_prompt_logprobs_in_the_same_call(client):
    """vLLM's chat prompt_logprobs: beside the choices, one entry per position of the
    templated prompt (the first: null)."""
    body = _chat(client, prompt_logprobs=1).json()
    prompt = body["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) > 2
    assert all(list(entry.values())[0]["logprob"] == -1.0 for entry in prompt[1:])
    assert [c["token"] for c in body["choices"][0]["logprobs"]["content"]] == ["a", "b", "c"]
    assert _chat(client).json()["prompt_logprobs"] is None
    error = assert_openai_error(_chat(client, prompt_logprobs=1, stream=True), 400)
    assert error["param"] == "prompt_logprobs"
