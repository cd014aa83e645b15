"""Structured outputs through the chat endpoint with the official openai client and SmolLM2:
response_format json_schema / json_object, vLLM's guided_* fields, `chat.completions.parse`
with a pydantic model, tool_choice required and a named function (whole and streamed); a bad
schema is a 400 and the server keeps serving."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.serve.conftest import MODEL
from tests.serve.helpers import assert_openai_error, wait_until_idle

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Describe a person called Ann who is 30."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
GREEDY = dict(model=MODEL, temperature=0, max_tokens=80)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def _engine_idle_after(smollm2):
    yield
    wait_until_idle(smollm2)


def test_json_schema_response_format(client):
    out = client.chat.completions.create(messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                               "strict": True}}, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


def test_json_object_response_format(client):
    out = client.chat.completions.create(messages=ASK, response_format={"type": "json_object"},
                                         **GREEDY)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:   # a tiny model may ramble inside the object; it is a JSON object's start still
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].message.content.lstrip().startswith("{")


def test_vllm_guided_fields(client):
    choice = client.chat.completions.create(messages=ASK, extra_body={
        "guided_choice": ["yes", "no", "maybe"]}, **GREEDY)
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    regex = client.chat.completions.create(messages=ASK, extra_body={
        "guided_regex": r"[A-Z][a-z]{2,8} is [0-9]{1,2}\."}, **GREEDY)
    assert re.fullmatch(r"[A-Z][a-z]{2,8} is [0-9]{1,2}\.", regex.choices[0].message.content)
    schema = client.chat.completions.create(messages=ASK, extra_body={"guided_json": PERSON},
                                            **GREEDY)
    jsonschema.validate(json.loads(schema.choices[0].message.content), PERSON)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.mark.parametrize("api", ["chat", "beta.chat"])
def test_parse_with_a_pydantic_model(client, api):
    completions = client.beta.chat.completions if api == "beta.chat" else client.chat.completions
    out = completions.parse(messages=ASK, response_format=Person, **GREEDY)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def _arguments(call, tool) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_tool_choice_required(client):
    out = client.chat.completions.create(messages=[{"role": "user", "content": "Weather in "
                                                    "Paris?"}], tools=[WEATHER, TIME],
                                         tool_choice="required", **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_")
        _arguments(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_named_function(client):
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": "What time is it?"}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, **GREEDY)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and out.choices[0].finish_reason == "tool_calls"
    _arguments(call, TIME)


def test_streamed_forced_tool_call(client):
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
        **GREEDY)
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}}, "response_format"),
    ({"guided_json": {"type": "frobnicate"}}, "guided_json"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_bad_guidance_is_400_and_the_server_keeps_serving(http, fields, param):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                       "max_tokens": 4, **fields})
    error = assert_openai_error(response, 400)
    assert error["param"] == param, error
    ok = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK,
                                                 "max_tokens": 2})
    assert ok.status_code == 200, ok.text


# ---- issue 31: guidance no output can satisfy ----

IMPOSSIBLE_OBJECT = {"type": "object", "properties": {
    "x": {"type": "string", "pattern": "[^\\s\\S]"}}, "required": ["x"]}
UNSATISFIABLE = [
    ("/v1/chat/completions", {"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    ("/v1/chat/completions", {"guided_grammar": 'root ::= root "a"'}, "guided_grammar"),
    ("/v1/chat/completions", {"guided_grammar": "root ::= x\nx ::= x"}, "guided_grammar"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": IMPOSSIBLE_OBJECT}}}, "response_format"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x",
                                           "schema": IMPOSSIBLE_OBJECT}}}, "text.format"),
]
BODIES = {"/v1/chat/completions": {"model": MODEL, "messages": ASK, "max_tokens": 8},
          "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 8}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,fields,param", UNSATISFIABLE,
                         ids=[c[2] + ":" + json.dumps(c[1])[:40] for c in UNSATISFIABLE])
def test_unsatisfiable_guidance_is_a_400_before_any_work(http, path, fields, param, stream):
    """They failed after 3-4 s with "token 0 does not continue the grammar" (a 500; streamed:
    an internal_error event)."""
    response = http.post(path, json={**BODIES[path], **fields, "stream": stream})
    error = assert_openai_error(response, 400)
    assert error["param"] == param and "admits no output" in error["message"], error


def test_a_dead_end_met_while_generating_is_a_400(http):
    """Three letters, then nothing: beyond what the check at submission searches; the
    request fails at the dead end, alone, as the client's error."""
    body = {**BODIES["/v1/chat/completions"], "guided_regex": "[a-z]{3}[^\\s\\S]"}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["code"] == "unsatisfiable_grammar", error
    response = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unsatisfiable_grammar")


# ---- issue 38: forced calls are tool_calls, streamed or not, whole or cut short ----

def _streamed_calls(stream) -> tuple[str, dict, str | None]:
    """(content, {index: [name, arguments]}, finish_reason) of a streamed chat answer."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_streamed_tool_choice_required(client):
    content, calls, finish = _streamed_calls(client.chat.completions.create(
        messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, TIME],
        tool_choice="required", stream=True, **GREEDY))
    assert content == "" and finish == "tool_calls" and calls
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for name, arguments in calls.values():
        jsonschema.validate(json.loads(arguments), tools[name]["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_cut_short_is_still_a_tool_call(client, tool_choice, stream):
    """max_tokens ends the call midway: the call as written (OpenAI's answer), not text."""
    fields = dict(messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                  tool_choice=tool_choice, model=MODEL, temperature=0, max_tokens=16)
    if stream:
        content, calls, finish = _streamed_calls(
            client.chat.completions.create(stream=True, **fields))
        names = [name for name, _ in calls.values()]
    else:
        choice = client.chat.completions.create(**fields).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        names = [call.function.name for call in choice.message.tool_calls or ()]
    assert content == "" and finish == "length"
    assert names == ["get_weather"]
