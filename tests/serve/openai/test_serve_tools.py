"""Tool calling in the chat endpoint: each --tool-call-parser on fixed strings; tool_choice
auto parsed from a scripted engine's output (whole and streamed, reassembled by the official
openai client); the history's tool_calls and tool messages through SmolLM2's chat template;
request validation."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.openai.protocol import ChatCompletionRequest
from tests.serve.scripted import ScriptedLLM
from tllm.serve.testing import ServerThread
from tllm.serve.openai.tool_calls import ToolRequest, forced_schema, parse_forced
from tllm.serve.openai.tool_parsers import TOOL_PARSERS, tool_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _parse(parser: str, text: str):
    content, calls = TOOL_PARSERS[parser].parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser, text, expected", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
     "\n</tool_call>", ("Let me look.", [("get_weather", {"city": "Paris"}),
                                         ("get_time", {})])),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}',
     (None, [("get_time", {"tz": "UTC"})])),    # unclosed last block, string arguments
    ("hermes", "It is sunny.", ("It is sunny.", [])),
    ("hermes", "<tool_call>{not json}</tool_call>", ("<tool_call>{not json}</tool_call>", [])),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     (None, [("get_weather", {"city": "Paris"})])),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; '
     '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
     (None, [("get_time", {}), ("get_weather", {"city": "Oslo"})])),
    ("llama3_json", "The answer is {42}.", ("The answer is {42}.", [])),
    ("mistral", 'Sure[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
     '{"name": "get_time", "arguments": {}}]',
     ("Sure", [("get_weather", {"city": "Rome"}), ("get_time", {})])),
    ("mistral", '[{"name": "get_time", "arguments": {}}]', (None, [("get_time", {})])),
    ("mistral", "[1, 2, 3]", ("[1, 2, 3]", [])),
])
def test_parser_on_fixed_strings(parser, text, expected):
    assert _parse(parser, text) == expected


@pytest.mark.parametrize("parser, text, start", [
    ("hermes", "Let me <tool_", 7), ("hermes", "Let me see", None),
    ("hermes", "a <tool_call>{", 2), ("llama3_json", " {", 1), ("llama3_json", "Hi", None),
    ("llama3_json", "<|py", 0), ("mistral", "x[TOOL", 1), ("mistral", "Hello", None),
])
def test_where_calls_may_start_while_streaming(parser, text, start):
    assert TOOL_PARSERS[parser].calls_start(text) == start


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="tool_call_parser"):
        tool_parser("xlam")


def _request(**fields) -> ToolRequest:
    return ToolRequest.of_chat(ChatCompletionRequest.model_validate(
        {"messages": ASK, "tools": [WEATHER, TIME], **fields}))


def test_forced_schemas_and_their_outputs():
    named = _request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert forced_schema(named) == WEATHER["function"]["parameters"]
    assert [(c.name, c.arguments) for c in parse_forced('{"city": "Nice"}', named)] == [
        ("get_weather", '{"city": "Nice"}')]
    required = _request(tool_choice="required", parallel_tool_calls=False)
    schema = forced_schema(required)
    assert schema["minItems"] == schema["maxItems"] == 1
    assert [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == [
        "get_weather", "get_time"]
    calls = parse_forced('[{"name": "get_time", "arguments": {}}]', required)
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    assert parse_forced('[{"name": "get_time", "argu', required) == []   # cut by length


HERMES_OUTPUT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                 '{"city": "Paris", "days": 2}}\n</tool_call>')


@pytest.fixture(scope="module")
def scripted():
    llm = ScriptedLLM()
    with ServerThread(build_app(llm, ServerConfig(model="fake", tool_call_parser="hermes"))) \
            as server:
        yield llm, openai.OpenAI(base_url=server.base_url + "/v1", api_key="x",
                                 max_retries=0), server


def test_auto_tool_call_parsed(scripted):
    llm, client, _ = scripted
    llm.script = HERMES_OUTPUT
    out = client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, TIME])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_auto_without_a_call_is_text(scripted):
    llm, client, _ = scripted
    llm.script = "It is sunny <tool in Paris."
    out = client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == llm.script
    assert not out.choices[0].message.tool_calls


def test_tool_choice_none_leaves_the_text(scripted):
    llm, client, _ = scripted
    llm.script = HERMES_OUTPUT
    out = client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER],
                                         tool_choice="none")
    assert out.choices[0].message.content == HERMES_OUTPUT
    assert out.choices[0].finish_reason == "stop"


def test_streamed_tool_calls_reassemble(scripted):
    llm, client, _ = scripted
    llm.script = HERMES_OUTPUT
    stream = client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER],
                                            stream=True, n=2)
    content, calls, finish = {0: "", 1: ""}, {0: {}, 1: {}}, {}
    for chunk in stream:
        for choice in chunk.choices:
            content[choice.index] += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls[choice.index].setdefault(delta.index, {"arguments": ""})
                call.update({k: v for k, v in (("id", delta.id),
                                               ("name", delta.function.name)) if v})
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        assert content[index].strip() == "I will check."   # the call's text never streamed
        (call,) = calls[index].values()
        assert call["id"].startswith("call_") and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Paris", "days": 2}


def test_history_with_tool_calls_and_results(scripted):
    llm, client, _ = scripted
    llm.script = "It is sunny."
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    out = client.chat.completions.create(model="fake", messages=messages, tools=[WEATHER])
    assert out.choices[0].message.content == "It is sunny."
    assert "tool: sunny, 21 C" in bytes(llm.last_prompt).decode()


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     None),
    ({"tool_choice": "required"}, None),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests_are_400(scripted, fields, param):
    _, _, server = scripted
    body = {"model": "fake", "messages": ASK, **fields}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=10)
    error = assert_openai_error(response, 400)
    if param is not None:
        assert error["param"] == param, error


def test_smollm2_template_renders_tool_history(smollm2):
    messages = [m for m in ASK] + [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    text = smollm2.tokenizer.apply_chat_template(messages, tools=[WEATHER])
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text


# ---- incremental tool-call deltas ----

@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa'),
])
def test_partial_calls_while_streaming(parser, text):
    (call,) = TOOL_PARSERS[parser].partial_calls(text)
    assert (call.name, call.arguments, call.is_complete) == ("get_weather", '{"city": "Pa',
                                                             False)
    assert TOOL_PARSERS[parser].partial_calls(text[:text.index('"name"') + 8]) == []


def test_partial_calls_of_forced_outputs():
    required = _request(tool_choice="required")
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci'
    calls = [(c.name, c.arguments, c.is_complete)
             for c in tllm_forced_partial_calls(text, required)]
    assert calls == [("get_time", "{}", True), ("get_weather", '{"ci', False)]
    named = _request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = tllm_forced_partial_calls('{"city": "a}"}', named)
    assert call.name == "get_weather" and call.is_complete   # a brace in a string is text


def tllm_forced_partial_calls(text, tools):
    from tllm.serve.openai.tool_calls import forced_partial_calls
    return forced_partial_calls(text, tools)


def _tool_call_deltas(client, **fields) -> list:
    stream = client.chat.completions.create(model="fake", messages=ASK, stream=True, **fields)
    return [delta for chunk in stream for choice in chunk.choices
            for delta in choice.delta.tool_calls or ()]


@pytest.mark.parametrize("script, fields", [
    (HERMES_OUTPUT, {}),
    ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
     {"tool_choice": "required"}),
    ('{"city": "Paris", "days": 2}',
     {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
])
def test_streamed_arguments_come_in_pieces(scripted, script, fields, monkeypatch):
    import tllm.guided
    monkeypatch.setattr(tllm.guided, "compile_check", lambda *args: None)  # a fake vocabulary
    llm, client, _ = scripted
    llm.script = script
    first, *rest = _tool_call_deltas(client, tools=[WEATHER, TIME], **fields)
    assert first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert len(rest) > 5    # one a token (a character here)
    assert all(d.id is None and d.function.name is None and d.index == 0 and d.function.arguments
               for d in rest)
    arguments = (first.function.arguments or "") + "".join(d.function.arguments for d in rest)
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    # the openai client's own stream helper assembles the same call
    with client.chat.completions.stream(model="fake", messages=ASK, tools=[WEATHER, TIME],
                                        **fields) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_call_with_string_arguments_streams_whole_at_the_end(scripted):
    llm, client, _ = scripted
    llm.script = '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
    (delta,) = _tool_call_deltas(client, tools=[WEATHER])
    assert delta.function.name == "get_weather"
    assert json.loads(delta.function.arguments) == {"city": "Oslo"}


# ---- forced calls cut short by max_tokens (issue 38: they came back as text in content) ----

NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("script, tool_choice, expected", [
    ('[{"name": "get_weather", "arguments": {"city": "Pa', "required",
     [("get_weather", '{"city": "Pa')]),
    ('{"city": "Pa', NAMED, [("get_weather", '{"city": "Pa')]),
    ('[{"name": "get_weather", "argu', "required", [("get_weather", "")]),
    ('[{"name": "get_wea', "required", []),     # not even a name yet: no call, no text
])
def test_forced_calls_cut_short_are_calls_not_text(scripted, monkeypatch, stream, script,
                                                   tool_choice, expected):
    """As OpenAI answers a call cut by max_tokens: the call with its arguments as written,
    finish_reason length; never the grammar's JSON as content."""
    import tllm.guided
    monkeypatch.setattr(tllm.guided, "compile_check", lambda *args: None)  # a fake vocabulary
    llm, client, _ = scripted
    monkeypatch.setattr(llm, "finish_reason", "length")
    llm.script = script
    fields = dict(model="fake", messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice)
    if not stream:
        choice = client.chat.completions.create(**fields).choices[0]
        assert choice.message.content is None and choice.finish_reason == "length"
        assert [(c.function.name, c.function.arguments)
                for c in choice.message.tool_calls or ()] == expected
        return
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (content, [tuple(call) for call in calls.values()], finish) == ("", expected,
                                                                          "length")
