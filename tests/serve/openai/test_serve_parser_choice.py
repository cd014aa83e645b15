"""`--tool-call-parser auto` / `--reasoning-parser auto` (the command line's default): the
parsers a chat template implies, on tiny template strings; `none` and explicit names; the
choice logged; an app built with `auto` parses the chosen format."""
from __future__ import annotations

import logging
import types

import openai
import pytest

from tests.serve.scripted import ScriptedLLM
from tests.serve.test_serve_cli_args import parse
from tests.serve.openai.test_serve_tools import ASK, WEATHER
from tllm.serve.cli_args import server_config
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.openai.parser_choice import REASONING_MARKS, TOOL_MARKS, resolve_parsers
from tllm.serve.testing import ServerThread

DS_TOOLS = "<｜tool▁calls▁begin｜>"


def _tokenizer(template):
    return types.SimpleNamespace(hf=types.SimpleNamespace(chat_template=template))


def _chosen(template, tools="auto", reasoning="auto", **config):
    resolved = resolve_parsers(ServerConfig(tool_call_parser=tools, reasoning_parser=reasoning,
                                            **config), _tokenizer(template))
    return resolved.tool_call_parser, resolved.reasoning_parser


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}", (None, None)),
    ("{{ '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}", ("hermes", None)),
    ("<tool_call>{{ x }}</tool_call>{% if thinking %}<think>\\n{% endif %}", ("hermes", "think")),
    ("<tool_call>\\n<function={{ name }}>\\n<parameter=", ("qwen3_coder", None)),
    (DS_TOOLS + "{{ calls }}<think>", ("deepseek_v3", "think")),
    ("[TOOL_CALLS]{{ calls | tojson }}", ("mistral", None)),
    ("<|python_tag|>{{ call }}", ("llama3_json", None)),
    ("<|start|>assistant<|channel|>analysis<|message|>", (None, "gpt_oss")),
    ("Your thought process should start with 'Here is my thought process:'", (None, "granite")),
    ("<tool_call> or [TOOL_CALLS]", (None, None)),  # two formats: ambiguous
    ("<|channel|> and <think>", (None, None)),
    (None, (None, None)),
])
def test_choice_from_the_template(template, expected):
    assert _chosen(template) == expected


def test_every_mark_names_a_parser():
    from tllm.serve.openai.reasoning import REASONING_PARSERS
    from tllm.serve.openai.tool_parsers import TOOL_PARSERS
    assert set(TOOL_MARKS.values()) <= set(TOOL_PARSERS)
    assert set(REASONING_MARKS.values()) <= set(REASONING_PARSERS)


def test_none_and_names_are_kept_and_unknown_names_refused():
    assert _chosen("<tool_call><think>", tools="none", reasoning="none") == (None, None)
    assert _chosen("<tool_call>", tools="pythonic", reasoning="qwen3") == ("pythonic", "qwen3")
    assert _chosen("<tool_call>", tools=None, reasoning=None) == (None, None)
    with pytest.raises(ValueError, match="tool_call_parser"):
        _chosen("", tools="xlam")
    with pytest.raises(ValueError, match="reasoning_parser"):
        _chosen("", reasoning="o1")


def test_the_servers_template_and_named_templates():
    assert _chosen("plain", chat_template="[TOOL_CALLS]") == ("mistral", None)
    named = {"default": "<|im_start|>", "tool_use": "<tool_call>"}
    assert _chosen(named) == ("hermes", None)
    assert resolve_parsers(ServerConfig(tool_call_parser="auto"), None).tool_call_parser is None


def test_the_choice_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="tllm.serve.openai.parser_choice"):
        _chosen("<tool_call><|channel|>")
        _chosen("<tool_call>[TOOL_CALLS]")
    messages = [record.getMessage() for record in caplog.records]
    assert any("tool-call parser: hermes (chosen from the chat template" in m for m in messages)
    assert any("reasoning parser: gpt_oss" in m for m in messages)
    assert any("hermes and mistral" in m for m in messages)


def test_command_line_default_is_auto_and_none_opts_out():
    config = server_config(parse(), "smollm2")
    assert (config.tool_call_parser, config.reasoning_parser) == ("auto", "auto")
    config = server_config(parse("--tool-call-parser", "none", "--reasoning-parser", "none"),
                           "smollm2")
    assert _chosen("<tool_call><think>", config.tool_call_parser,
                   config.reasoning_parser) == (None, None)


def test_an_app_built_with_auto_parses_the_templates_format():
    llm = ScriptedLLM()
    llm.tokenizer.hf = types.SimpleNamespace(chat_template="<tool_call>{{ call }}</tool_call>")
    llm.script = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    config = ServerConfig(model="fake", tool_call_parser="auto", reasoning_parser="auto")
    with ServerThread(build_app(llm, config)) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        choice = client.chat.completions.create(model="fake", messages=ASK,
                                                tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
