"""--reasoning-parser: `<think>...</think>`, Granite's phrases and gpt-oss's harmony channels
split into reasoning_content, on fixed strings, streamed character by character, and through
the chat endpoint (whole and streamed) over a scripted engine, with tool calls after the
reasoning."""
from __future__ import annotations

import contextlib
import json

import openai
import pytest

from tests.serve.scripted import ScriptedLLM
from tests.serve.openai.test_serve_tools import ASK, WEATHER
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.openai.reasoning import REASONING_PARSERS, ReasoningStream, reasoning_parser
from tllm.serve.testing import ServerThread

HARMONY = ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final"
           "<|message|>Paris.<|return|>")


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", ("\nLet me think.\n", "Paris.")),
    ("qwen3", "Paris.", ("", "Paris.")),
    ("qwen3", "<think>still thinking", ("still thinking", "")),
    ("deepseek_r1", "Let me think.</think>Paris.", ("Let me think.", "Paris.")),
    ("deepseek_r1", "<think>Hm.</think>Paris.", ("Hm.", "Paris.")),
    ("deepseek_r1", "cut short by length", ("cut short by length", "")),
    ("think", "<think>Hm.</think>Paris.", ("Hm.", "Paris.")),
    ("think", "Paris.", ("", "Paris.")),
    ("granite", "Here is my thought process:\nHm.\nHere is my response:\nParis.",
     ("\nHm.\n", "Paris.")),
    ("granite", "Here's my thought process: Hm. Here's my response: Paris.",
     (" Hm. ", "Paris.")),
    ("granite", "Here is Paris.", ("", "Here is Paris.")),
    ("granite", "Here is my thought process: cut short", (" cut short", "")),
    ("gpt_oss", HARMONY, ("Hm.", "Paris.")),
    ("gpt_oss", "<|channel|>final<|message|>Paris.<|return|>", ("", "Paris.")),
    ("gpt_oss", "<|channel|>analysis<|message|>cut short", ("cut short", "")),
    ("gpt_oss", "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>"
                "commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>final"
                "<|message|>Paris.<|return|>", ("Hm.", "Let me look.Paris.")),
    ("gpt_oss", "analysisHm.assistantfinalParis.", ("", "analysisHm.assistantfinalParis.")),
    ("gpt_oss", "Paris. <|channel|>", ("", "Paris. <|channel|>")),
])
def test_split_on_fixed_strings(parser, text, expected):
    assert REASONING_PARSERS[parser].split(text) == expected


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", ["<think>a</thin b</think>\nc <th d", "plain <think> text",
                                  "x</think>y", "<", HARMONY, HARMONY[:40], "<|chan",
                                  "Here is my thought process: a Here's my resp b",
                                  "Here's my thought process: a Here is my response: b"])
def test_streamed_split_equals_the_whole(parser, text):
    stream = ReasoningStream(REASONING_PARSERS[parser])
    parts = [stream.add(char) for char in text] + [stream.add("", is_final=True)]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == \
        REASONING_PARSERS[parser].split(text)


def test_think_reads_the_prompt():
    """`think`: reasoning from the start when the template opened it (DeepSeek-R1, Qwen3's
    thinking models), as qwen3 otherwise (Qwen3 with enable_thinking false closes it)."""
    think = REASONING_PARSERS["think"]
    opened = think.for_prompt("<|im_start|>assistant\n<think>\n")
    assert opened.split("Hm.</think>Paris.") == ("Hm.", "Paris.")
    closed = think.for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closed.split("Paris.") == ("", "Paris.")
    assert think.for_prompt("<|im_start|>assistant\n").split("Paris.") == ("", "Paris.")


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


@pytest.fixture(scope="module")
def servers():
    """A scripted server for each of gpt_oss, granite and think."""
    with contextlib.ExitStack() as stack:
        clients = {}
        for name in ("gpt_oss", "granite", "think"):
            llm = ScriptedLLM()
            server = stack.enter_context(ServerThread(build_app(
                llm, ServerConfig(model="fake", reasoning_parser=name))))
            clients[name] = llm, openai.OpenAI(base_url=server.base_url + "/v1",
                                               api_key="x", max_retries=0)
        yield clients


def _reasoning_and_content(client, **fields) -> tuple[tuple, tuple]:
    """((reasoning, content) whole, (reasoning, content) streamed)."""
    fields = {"model": "fake", "messages": ASK, **fields}
    message = client.chat.completions.create(**fields).choices[0].message
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    return (message.model_extra["reasoning_content"], message.content), (reasoning, content)


def test_gpt_oss_channels_with_special_tokens_decoded(servers):
    llm, client = servers["gpt_oss"]
    llm.script = HARMONY
    whole, streamed = _reasoning_and_content(client)
    assert whole == streamed == ("Hm.", "Paris.")
    assert llm.last_params.skip_special_tokens is False     # the channels are special tokens
    _reasoning_and_content(client, extra_body={"skip_special_tokens": True})
    assert llm.last_params.skip_special_tokens is True      # as the request says


def test_granite_phrases(servers):
    llm, client = servers["granite"]
    llm.script = "Here is my thought process:\nHm.\n\nHere is my response:\nParis."
    whole, streamed = _reasoning_and_content(client)
    assert whole == streamed == ("\nHm.\n\n", "Paris.")
    assert llm.last_params.skip_special_tokens is True


def test_granite_guidance_applies_from_the_first_token(servers, monkeypatch):
    import tllm.guided
    monkeypatch.setattr(tllm.guided, "compile_check", lambda *args: None)  # a fake vocabulary
    llm, client = servers["granite"]
    llm.script = '{"a": 1}'
    client.chat.completions.create(model="fake", messages=ASK,
                                   response_format={"type": "json_object"})
    assert llm.last_params.guided_decoding.reasoning_tags is None


def test_think_told_by_the_prompt(servers):
    llm, client = servers["think"]
    llm.script = "Hm.</think>Paris."
    # the fake template writes the messages as they are: this prompt ends inside <think>
    opened = [{"role": "user", "content": "Weather? <think>"}]
    whole, streamed = _reasoning_and_content(client, messages=opened)
    assert whole == streamed == ("Hm.", "Paris.")
    whole, _ = _reasoning_and_content(client)
    assert whole == (None, "Hm.</think>Paris.")
