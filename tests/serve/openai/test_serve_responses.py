"""POST /v1/responses: the official openai client's `client.responses.create` against SmolLM2
(text equal to LLM.chat's greedy output, instructions, streaming events, a multi-turn through
previous_response_id, errors in OpenAI's types), and against the fake engine the store's
bound, the event order and sequence numbers, input items and refusals."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.serve.conftest import MODEL
from tests.serve.helpers import assert_openai_error, wait_until_idle
from tllm import SamplingParams
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.openai.responses import ResponseStore, StoredResponse
from tllm.serve.openai.responses_protocol import ResponseObject
from tllm.serve.testing import FakeLLM, ServerThread

QUESTION = "What is the capital of France?"
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
DONE_EVENTS = ["response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


@pytest.fixture(scope="module")
def fake_server():
    with ServerThread(build_app(FakeLLM(), ServerConfig(model="fake"))) as srv:
        yield srv


@pytest.fixture()
def fake_http(fake_server):
    with httpx.Client(base_url=fake_server.base_url, timeout=30) as client:
        yield client


# ---- the official client against SmolLM2 ----

@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def _idle_after(smollm2):
    yield
    wait_until_idle(smollm2)


@pytest.mark.slow
@pytest.mark.usefixtures("_idle_after")
def test_create_with_instructions_equals_llm_chat(client, smollm2):
    out = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer briefly.",
                                  max_output_tokens=12, temperature=0)
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": QUESTION}]
    expected = smollm2.chat(messages, greedy(12), use_tqdm=False)
    assert out.output_text == expected.outputs[0].text and "Paris" in out.output_text
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.usage.input_tokens == len(expected.prompt_token_ids)
    assert out.usage.output_tokens == len(expected.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.instructions == "Answer briefly." and out.max_output_tokens == 12
    if expected.outputs[0].finish_reason == "length":
        assert out.status == "incomplete"
        assert out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed"


@pytest.mark.slow
@pytest.mark.usefixtures("_idle_after")
def test_stream_events_and_text(client, smollm2):
    events = list(client.responses.create(model=MODEL, input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=10, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == STREAM_EVENTS and types[-4:-1] == DONE_EVENTS
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    expected = smollm2.chat([{"role": "user", "content": QUESTION}], greedy(10),
                            use_tqdm=False).outputs[0]
    assert text == expected.text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == len(expected.token_ids)
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type == "response.output_text.delta")


@pytest.mark.slow
@pytest.mark.usefixtures("_idle_after")
def test_multi_turn_previous_response_id(client, smollm2):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=8,
                                     temperature=0)
    conversation = [{"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    expected = smollm2.chat(conversation, greedy(8), use_tqdm=False)
    assert second.output_text == expected.outputs[0].text
    assert second.usage.input_tokens == len(expected.prompt_token_ids)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text


@pytest.mark.slow
def test_unknown_previous_response_id_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


@pytest.mark.slow
def test_bad_input_is_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=[])
    assert info.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hi", max_output_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])


# ---- the fake engine: store, events, items, refusals ----

def test_store_drops_least_recently_used():
    store = ResponseStore(max_size=2)
    first, second, third = (StoredResponse(ResponseObject(model="m"), []) for _ in range(3))
    store.put(first)
    store.put(second)
    store.get(first.response.id)        # used: second is now the oldest
    store.put(third)
    assert len(store) == 2 and store.get(first.response.id) is first
    with pytest.raises(Exception) as info:
        store.get(second.response.id)
    assert info.value.status == 404
    with pytest.raises(ValueError, match="max_size"):
        ResponseStore(max_size=0)


def test_incomplete_by_length_and_not_stored(fake_http):
    body = fake_http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3,
                                                 "store": False}).json()
    assert body["status"] == "incomplete" and body["output"][0]["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "abc"
    assert body["usage"]["output_tokens"] == 3 and body["store"] is False
    assert_openai_error(fake_http.get(f"/v1/responses/{body['id']}"), 404)


def test_stream_sse_lines(fake_http):
    with fake_http.stream("POST", "/v1/responses", json={
            "input": "hi", "max_output_tokens": 2, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert names == [d["type"] for d in data]
    assert names == [*STREAM_EVENTS, *["response.output_text.delta"] * 2, *DONE_EVENTS,
                     "response.incomplete"]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert lines[-1] == "data: [DONE]"


def test_input_items_through_the_template(fake_http):
    items = [{"type": "message", "role": "developer", "content": "Be terse."},
             {"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "c1", "name": "weather",
              "arguments": "{\"city\": \"Paris\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    body = fake_http.post("/v1/responses", json={"input": items, "instructions": "Hi.",
                                                 "max_output_tokens": 1}).json()
    # FakeTokenizer: one token a byte of "role: content" lines, then "\nassistant: ".
    prompt = "\n".join(["system: Hi.", "system: Be terse.", "user: Weather?", "assistant: ",
                        "tool: sunny"]) + "\nassistant: "
    assert body["usage"]["input_tokens"] == len(prompt.encode())


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": []}]},
     "tools.0"),
    ({"input": "hi", "n": 2}, "n"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1"}]},
     "input"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format"),
])
def test_refusals_name_the_field(fake_http, body, param):
    error = assert_openai_error(fake_http.post("/v1/responses", json=body), 400)
    assert error["param"] == param


def test_schema_that_does_not_compile_is_bad_request(fake_http):
    response = fake_http.post("/v1/responses", json={"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "bad", "schema": {"type": "no-such-type"}}}})
    assert assert_openai_error(response, 400)["param"] == "text.format"


@pytest.mark.slow
@pytest.mark.usefixtures("_idle_after")
def test_json_schema_format_output_validates(client):
    schema = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon"]}},
              "required": ["capital"], "additionalProperties": False}
    out = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0,
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema,
                         "strict": True}})
    assert out.status == "completed", out.output_text
    jsonschema.validate(json.loads(out.output_text), schema)
    assert out.text.format.type == "json_schema"


@pytest.mark.slow
@pytest.mark.usefixtures("_idle_after")
def test_json_object_format_streamed(client):
    events = list(client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0, stream=True,
        text={"format": {"type": "json_object"}}))
    text = events[-1].response.output_text
    assert text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    if events[-1].type == "response.completed":
        assert isinstance(json.loads(text), dict)
    else:   # cut by length: still the start of a JSON object
        assert events[-1].type == "response.incomplete" and text.lstrip().startswith("{")
