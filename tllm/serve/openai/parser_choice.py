"""`--tool-call-parser auto` and `--reasoning-parser auto` (the command line's default): the
parser a model's chat template implies, where the template names one format's marks and no
other's. Ambiguous or silent templates get none (plain text), and the log says so."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from tllm.serve.context import ServerConfig
from tllm.serve.openai.reasoning import reasoning_parser
from tllm.serve.openai.tool_parsers import tool_parser

logger = logging.getLogger(__name__)
AUTO = "auto"

# A mark in the template -> the parser of its format
TOOL_MARKS = {"<function=": "qwen3_coder", "<tool_call>": "hermes",
              "<｜tool▁calls▁begin｜>": "deepseek_v3", "[TOOL_CALLS]": "mistral",
              "<|python_tag|>": "llama3_json"}  # pythonic has no mark of its own
REASONING_MARKS = {"<|channel|>": "gpt_oss", "<think>": "think",
                   "Here is my thought process:": "granite"}
# Formats that contain another's marks: Qwen3-Coder wraps its XML in hermes' <tool_call>
_CONTAINS = {"qwen3_coder": "hermes"}


def parser_in_template(template: str | None, marks: dict[str, str]) -> tuple[str | None,
                                                                            list[str]]:
    """(the one parser the template's marks imply or None, every parser they name)."""
    found = {name for mark, name in marks.items() if template and mark in template}
    found -= {_CONTAINS[name] for name in found if name in _CONTAINS}
    named = sorted(found)
    return (named[0] if len(named) == 1 else None), named


def chat_template_text(config: ServerConfig, tokenizer: Any) -> str | None:
    """The chat template the server renders with: --chat-template, else the model's (every
    named template of a tokenizer that has several)."""
    if config.chat_template is not None:
        return config.chat_template
    template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else None


def resolve_parsers(config: ServerConfig, tokenizer: Any) -> ServerConfig:
    """The config with `auto` parsers chosen from the chat template (and logged); ValueError
    for a parser name that does not exist."""
    template = chat_template_text(config, tokenizer)
    tools = _resolved(config.tool_call_parser, template, TOOL_MARKS, "tool-call")
    reasoning = _resolved(config.reasoning_parser, template, REASONING_MARKS, "reasoning")
    tool_parser(tools)
    reasoning_parser(reasoning)
    return replace(config, tool_call_parser=tools, reasoning_parser=reasoning)


def _resolved(name: str | None, template: str | None, marks: dict[str, str],
              kind: str) -> str | None:
    if name != AUTO:
        return None if name == "none" else name
    chosen, named = parser_in_template(template, marks)
    if chosen is not None:
        logger.info("%s parser: %s (chosen from the chat template; --%s-parser none turns "
                    "it off)", kind, chosen, kind)
    elif named:
        logger.warning("%s parser: none (the chat template has the marks of %s: pass "
                       "--%s-parser to choose)", kind, " and ".join(named), kind)
    else:
        logger.info("%s parser: none (the chat template names no format)", kind)
    return chosen
