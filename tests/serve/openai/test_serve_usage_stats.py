"""vLLM's stream_options.continuous_usage_stats (issue 14, finding 4): with it every streamed
chunk carries usage (the choice's prompt tokens, its completion tokens so far, their total),
for completions and chat; guidellm 0.8.1's requests, exactly as it sends them (chat content
as a list of text parts), succeed end to end on SmolLM2."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import MODEL
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GUIDELLM_STREAM = {"stream": True,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def sse_chunks(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def check_continuous_usage(chunks: list[dict], num_prompt_tokens: int, num_tokens: int) -> str:
    """Every chunk but the last has usage growing to num_tokens; the last is usage alone, the
    total (include_usage). Returns the streamed text."""
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": num_prompt_tokens, "completion_tokens": num_tokens,
        "total_tokens": num_prompt_tokens + num_tokens}
    so_far = [c["usage"]["completion_tokens"] for c in choice_chunks]
    assert so_far == sorted(so_far) and so_far[-1] == num_tokens
    for chunk in choice_chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == num_prompt_tokens
        assert usage["total_tokens"] == num_prompt_tokens + usage["completion_tokens"]
    choices = [c["choices"][0] for c in choice_chunks]
    assert choices[-1]["finish_reason"] == "length"
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for c in choices)


@pytest.mark.slow
def test_guidellm_chat_request_succeeds(http):
    """guidellm's chat body: content as parts, max_completion_tokens, stop null, ignore_eos."""
    parts = [{"type": "text", "text": "Write a haiku about the sea."}]
    body = {"model": MODEL, **GUIDELLM_STREAM, "max_completion_tokens": 12, "stop": None,
            "ignore_eos": True, "messages": [{"role": "user", "content": parts}]}
    chunks = sse_chunks(http.post(CHAT, json=body))
    plain = http.post(CHAT, json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": parts[0]["text"]}]}).json()
    num_prompt_tokens = plain["usage"]["prompt_tokens"]    # parts read as the plain string
    role_chunk = chunks[0]
    assert role_chunk["choices"][0]["delta"]["role"] == "assistant"
    assert role_chunk["usage"]["completion_tokens"] == 0
    assert check_continuous_usage(chunks, num_prompt_tokens, 12)


@pytest.mark.slow
def test_list_content_is_the_string_content(http):
    """The same greedy answer for content as a string and as a list of one text part."""
    def answer(content) -> str:
        response = http.post(CHAT, json={"model": MODEL, "temperature": 0, "max_tokens": 8,
                                         "messages": [{"role": "user", "content": content}]})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    assert answer([{"type": "text", "text": "Name a colour."}]) == answer("Name a colour.")


@pytest.mark.slow
def test_guidellm_completions_request_succeeds(http):
    body = {"model": MODEL, **GUIDELLM_STREAM, "max_tokens": 10, "stop": None,
            "ignore_eos": True, "prompt": "The history of the printing press"}
    chunks = sse_chunks(http.post(COMPLETIONS, json=body))
    num_prompt_tokens = http.post(COMPLETIONS, json={
        "model": MODEL, "prompt": body["prompt"], "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert check_continuous_usage(chunks, num_prompt_tokens, 10)


@pytest.fixture()
def fake_http():
    with ServerThread(build_app(FakeLLM(), ServerConfig(model="fake"))) as server, \
            httpx.Client(base_url=server.base_url, timeout=10) as client:
        yield client


@pytest.mark.parametrize("path,base", [
    (COMPLETIONS, {"prompt": ["ab", "abcd"]}),
    (CHAT, {"messages": [{"role": "user", "content": "ab"}]})])
def test_each_chunk_has_its_own_choices_usage(fake_http, path, base):
    """n > 1 (and several prompts): a chunk's usage is its choice's, as in vLLM; the final
    usage chunk is the request's total."""
    body = {"model": "fake", **base, "n": 2, "max_tokens": 3, **GUIDELLM_STREAM}
    chunks = sse_chunks(fake_http.post(path, json=body))
    *choice_chunks, last = chunks
    seen: dict[int, int] = {}
    for chunk in choice_chunks:
        index = chunk["choices"][0]["index"]
        usage = chunk["usage"]
        assert usage["completion_tokens"] >= seen.get(index, 0)
        seen[index] = usage["completion_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    num_choices = 4 if path == COMPLETIONS else 2
    assert seen == {i: 3 for i in range(num_choices)}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 * num_choices


@pytest.mark.parametrize("options,has_chunk_usage,has_total", [
    ({"include_usage": True}, False, True),
    ({"continuous_usage_stats": True}, True, False),
    ({}, False, False)])
def test_which_chunks_carry_usage(fake_http, options, has_chunk_usage, has_total):
    body = {"model": "fake", "prompt": "ab", "max_tokens": 2, "stream": True,
            "stream_options": options}
    chunks = sse_chunks(fake_http.post(COMPLETIONS, json=body))
    with_choices = [c for c in chunks if c["choices"]]
    assert all((c.get("usage") is not None) == has_chunk_usage for c in with_choices)
    assert (not chunks[-1]["choices"]) == has_total
