"""--reasoning-parser: `<think>...</think>` split into reasoning_content, on fixed strings,
streamed character by character, and through the chat endpoint (whole and streamed) over a
scripted engine, with tool calls after the reasoning."""
from __future__ import annotations

import json

import openai
import pytest

from tests.serve.scripted import ScriptedLLM
from tests.serve.test_serve_tools import ASK, WEATHER
from tllm.serve.context import ServerConfig
from tllm.serve.openai_server import build_app
from tllm.serve.reasoning import REASONING_PARSERS, ReasoningStream, reasoning_parser
from tllm.serve.testing import ServerThread


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", ("\nLet me think.\n", "Paris.")),
    ("qwen3", "Paris.", ("", "Paris.")),
    ("qwen3", "<think>still thinking", ("still thinking", "")),
    ("deepseek_r1", "Let me think.</think>Paris.", ("Let me think.", "Paris.")),
    ("deepseek_r1", "<think>Hm.</think>Paris.", ("Hm.", "Paris.")),
    ("deepseek_r1", "cut short by length", ("cut short by length", "")),
])
def test_split_on_fixed_strings(parser, text, expected):
    assert REASONING_PARSERS[parser].split(text) == expected


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", ["<think>a</thin b</think>\nc <th d", "plain <think> text",
                                  "x</think>y", "<"])
def test_streamed_split_equals_the_whole(parser, text):
    stream = ReasoningStream(REASONING_PARSERS[parser])
    parts = [stream.add(char) for char in text] + [stream.add("", is_final=True)]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == \
        REASONING_PARSERS[parser].split(text)


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser"):
        reasoning_parser("o1")


OUTPUT = ('<think>The user wants the weather.</think>\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def scripted():
    llm = ScriptedLLM()
    config = ServerConfig(model="fake", reasoning_parser="qwen3", tool_call_parser="hermes")
    with ServerThread(build_app(llm, config)) as server:
        yield llm, openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def test_reasoning_content_and_answer(scripted):
    llm, client = scripted
    llm.script = "<think>Paris is the capital.</think>\n\nParis."
    message = client.chat.completions.create(model="fake", messages=ASK).choices[0].message
    assert message.content == "Paris."
    assert message.model_extra["reasoning_content"] == "Paris is the capital."


def test_tool_call_after_reasoning(scripted):
    llm, client = scripted
    llm.script = OUTPUT
    choice = client.chat.completions.create(model="fake", messages=ASK,
                                            tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_streamed_reasoning_deltas(scripted):
    llm, client = scripted
    llm.script = "<think>Paris is the capital.</think>\n\nParis."
    reasoning = content = ""
    for chunk in client.chat.completions.create(model="fake", messages=ASK, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("Paris is the capital.", "Paris.")


def test_guided_requests_wait_for_the_reasoning(scripted, monkeypatch):
    import tllm.guided
    monkeypatch.setattr(tllm.guided, "compile_check", lambda *args: None)  # a fake vocabulary
    llm, client = scripted
    llm.script = '<think>An object.</think>{"a": 1}'
    out = client.chat.completions.create(model="fake", messages=ASK,
                                         response_format={"type": "json_object"})
    assert llm.last_params.guided_decoding.reasoning_tags == ("<think>", "</think>")
    assert json.loads(out.choices[0].message.content) == {"a": 1}
    client.responses.create(model="fake", input="hi", text={"format": {"type": "json_object"}})
    assert llm.last_params.guided_decoding.reasoning_tags == ("<think>", "</think>")
