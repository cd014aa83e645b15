"""The tool-call formats beside the JSON ones (qwen3_coder, pythonic, deepseek_v3) on fixed
strings, whole and streamed character by character (the streamed calls and text equal the
whole output's), malformed outputs as plain content; and through the chat endpoint over a
scripted engine with the official openai client."""
from __future__ import annotations

import json

import openai
import pytest

from tests.serve.scripted import ScriptedLLM
from tests.serve.openai.test_serve_tools import ASK, TIME, WEATHER
from tllm.serve.openai.choice_stream import ChoiceStream, OutputFormat
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.openai.protocol import ChatCompletionRequest
from tllm.serve.testing import ServerThread
from tllm.serve.openai.tool_calls import ToolRequest
from tllm.serve.openai.tool_parsers import TOOL_PARSERS

CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
# DeepSeek's special tokens (fullwidth bars, the ▁ mark)
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

WELL_FORMED = [
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "I will check.", CALLS),
    ("qwen3_coder", "<function=get_time>\n</function>", None, CALLS[1:]),  # no <tool_call>
    ("pythonic", '[get_weather(city="Paris", days=2), get_time()]', None, CALLS),
    ("pythonic", "<|python_start|>[get_weather(city='Paris', days=2)]<|python_end|>", None,
     CALLS[:1]),
    ("pythonic", '[get_weather(city="a)b]", days=2)]', None,
     [("get_weather", {"city": "a)b]", "days": 2})]),    # brackets in a string are text
    ("deepseek_v3", f'Sure.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n'
     f'{{"city": "Paris", "days": 2}}\n```{DS_END}\n{DS_CALL}function{DS_SEP}get_time\n'
     f"```json\n{{}}\n```{DS_END}{DS_CALLS_END}", "Sure.", CALLS),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}get_time{DS_SEP}{{}}{DS_END}{DS_CALLS_END}", None,
     CALLS[1:]),     # DeepSeek-V3.1's form
]

MALFORMED = [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"),
    ("qwen3_coder", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    ("qwen3_coder", "Write <function=f> like this."),
    ("qwen3_coder", "<function=f><parameter=x>NaN</parameter></function>"),
    ("pythonic", 'get_weather(city="Paris")'),
    ("pythonic", "[get_weather(city=Paris)]"),          # a name, not a literal
    ("pythonic", '[get_weather("Paris")]'),             # positional
    ("pythonic", '[os.system("ls")]'),                  # not a plain function name
    ("pythonic", "[__import__('os').system('ls')]"),
    ("pythonic", "[f(**kwargs)]"),
    ("pythonic", "[f(a={1, 2})]"),                      # a set: no JSON value
    ("pythonic", "[f(a=1e999)]"),                       # infinity: no JSON value
    ("pythonic", "[1, 2]"),
    ("pythonic", "[]"),
    ("pythonic", '[get_weather(city="Paris"'),
    ("pythonic", "[" * 1000),
    ("pythonic", "[f(a=" + "[" * 1000 + "]" * 1000 + ")]"),     # past the parser's nesting
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}function{DS_SEP}get_time\n```json\n{{}}\n```"),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{no}}\n```{DS_END}"),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n[1]\n```{DS_END}"),
]


def _tools(*tools) -> ToolRequest:
    return ToolRequest.of_chat(ChatCompletionRequest.model_validate(
        {"messages": ASK, "tools": list(tools or (WEATHER, TIME))}))


def _output(parser: str, *tools) -> OutputFormat:
    return OutputFormat.of(None, TOOL_PARSERS[parser], _tools(*tools))


def _whole(parser: str, text: str, *tools):
    _, content, calls = _output(parser, *tools).split(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser: str, text: str):
    """(content, calls, finish_reason) sent by a stream of one character a token."""
    stream = ChoiceStream(_output(parser))
    updates = [stream.add(char, None) for char in text] + [stream.add("", "stop")]
    calls: dict[int, list[str]] = {}
    for update in updates:
        for delta in update.calls:
            call = calls.setdefault(delta.index, [delta.name, ""])
            call[1] += delta.arguments
    return ("".join(u.content for u in updates),
            [(name, json.loads(arguments)) for name, arguments in calls.values()],
            updates[-1].finish_reason)


@pytest.mark.parametrize("parser, text, content, calls", WELL_FORMED)
def test_calls_whole_and_streamed(parser, text, content, calls):
    assert _whole(parser, text) == (content, calls)
    streamed_content, streamed_calls, finish = _streamed(parser, text)
    assert (streamed_content.strip() or None, streamed_calls) == (content, calls)
    assert finish == "tool_calls"


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_malformed_calls_are_content(parser, text):
    assert _whole(parser, text) == (text, [])
    assert _streamed(parser, text) == (text, [], "stop")


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic", "deepseek_v3"])
def test_plain_text_streams_at_once(parser):
    """Text that cannot become a call is sent as it comes, not held to the end."""
    stream = ChoiceStream(_output(parser))
    assert stream.add("It is sunny", None).content == "It is sunny"


def test_qwen3_coder_values_take_the_schemas_types():
    schema = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {
            "zip": {"type": "string"}, "n": {"type": "integer"}, "ok": {"type": "boolean"},
            "tags": {"type": "array"}, "where": {"type": "object"}}}}}
    text = ("<tool_call>\n<function=f>\n<parameter=zip>\n07001\n</parameter>\n"
            "<parameter=n>\n3\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n"
            "<parameter=tags>\n['a', 'b']\n</parameter>\n<parameter=where>\n"
            '{"x": 1}\n</parameter>\n<parameter=free>\nline one\nline two\n</parameter>\n'
            "</function>\n</tool_call>")
    assert _whole("qwen3_coder", text, schema) == (None, [("f", {
        "zip": "07001", "n": 3, "ok": True, "tags": ["a", "b"], "where": {"x": 1},
        "free": "line one\nline two"})])


@pytest.mark.parametrize("parser, text", [
    ("pythonic", '[get_weather(city="Paris", days=2), get_ti'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=get_ti"),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n'
                    f'{{"city": "Paris", "days": 2}}\n```{DS_END}\n{DS_CALL}func'),
])
def test_a_call_is_sent_once_it_is_whole(parser, text):
    (call,) = TOOL_PARSERS[parser].for_tools(_tools().functions).partial_calls(text)
    assert (call.name, json.loads(call.arguments), call.is_complete) == (*CALLS[0], True)


SCRIPTS = {"qwen3_coder": WELL_FORMED[0][1], "pythonic": WELL_FORMED[2][1],
           "deepseek_v3": WELL_FORMED[5][1]}


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def scripted(request):
    llm = ScriptedLLM()
    llm.script = SCRIPTS[request.param]
    config = ServerConfig(model="fake", tool_call_parser=request.param)
    with ServerThread(build_app(llm, config)) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def test_through_the_chat_endpoint(scripted):
    choice = scripted.chat.completions.create(model="fake", messages=ASK,
                                              tools=[WEATHER, TIME]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == CALLS
    with scripted.chat.completions.stream(model="fake", messages=ASK,
                                          tools=[WEATHER, TIME]) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in final.choices[0].message.tool_calls] == CALLS
    assert final.choices[0].finish_reason == "tool_calls"
