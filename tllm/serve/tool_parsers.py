"""Tool calls in the chat endpoint. `tool_choice="auto"`: the calls are parsed from the model's
own format (`--tool-call-parser` hermes | llama3_json | mistral). `"required"` and a named
function: the output is constrained by a JSON schema (as vLLM does): a JSON array of
{"name", "arguments"} objects for required, the function's arguments object for a named one;
so those outputs are parsed the same way whatever the model's format."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tllm.serve.protocol import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str      # a JSON object as text

    def tool_call(self) -> ToolCall:
        return ToolCall(id=new_call_id(), function=FunctionCall(name=self.name,
                                                                arguments=self.arguments))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    """A {"name", "arguments"} object as a call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _calls(objs: list[Any], arguments_key: str = "arguments") -> list[ParsedCall] | None:
    calls = [_call(obj, arguments_key) for obj in objs]
    return calls if calls and all(calls) else None


def _tail_is_prefix(text: str, marker: str) -> int | None:
    """Where a tail of text that starts marker begins (the marker itself or a part of it)."""
    found = text.find(marker)
    if found != -1:
        return found
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return None


class ToolParser:
    """A model's tool-call format: parse() a whole output, calls_start() for streaming."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls); an output without (well-formed) calls is all content."""
        raise NotImplementedError

    def calls_start(self, text: str) -> int | None:
        """Where the calls may begin in the text so far (None: all of it is content)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    one block per call, after any text."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        start = text.find(self.START)
        if start == -1:
            return text, []
        try:
            objs = [json.loads(block) for block in self._BLOCK.findall(text[start:])]
        except json.JSONDecodeError:
            return text, []
        calls = _calls(objs)
        if calls is None:
            return text, []
        return (text[:start].strip() or None), calls

    def calls_start(self, text):
        return _tail_is_prefix(text, self.START)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+ JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`), several separated by `;`."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text):
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, objs, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                obj, at = decoder.raw_decode(body, at)
                objs.append(obj)
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except json.JSONDecodeError:
            return text, []
        calls = _calls(objs, arguments_key="parameters")
        return (None, calls) if calls else (text, [])

    def calls_start(self, text):
        body = text.lstrip()
        if not body or body.startswith(("{", self.TAG)) or self.TAG.startswith(body):
            return len(text) - len(body)
        return None


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any text (with
    the special token skipped in decoding, a JSON array of calls at the start)."""

    name = "mistral"
    START = "[TOOL_CALLS]"

    def parse(self, text):
        start = text.find(self.START)
        body = text[start + len(self.START):] if start != -1 else text.lstrip()
        if start == -1 and not body.startswith("[{"):
            return text, []
        try:
            objs, _ = json.JSONDecoder().raw_decode(body.strip())
        except json.JSONDecodeError:
            return text, []
        calls = _calls(objs if isinstance(objs, list) else [objs])
        if calls is None:
            return text, []
        return (text[:start].strip() or None) if start != -1 else None, calls

    def calls_start(self, text):
        found = _tail_is_prefix(text, self.START)
        if found is not None:
            return found
        body = text.lstrip()
        return len(text) - len(body) if "[{".startswith(body[:2]) else None


TOOL_PARSERS = {parser.name: parser for parser in
                (HermesToolParser(), Llama3JsonToolParser(), MistralToolParser())}


def tool_parser(name: str | None) -> ToolParser | None:
    """The parser called name (None: `auto` gives plain text); ValueError naming the choices."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, "
                         f"got {name!r}")
    return TOOL_PARSERS[name]


def is_forced(body: ChatCompletionRequest) -> bool:
    """The request must call a tool: tool_choice required or a named function."""
    return bool(body.tools) and (body.tool_choice == "required"
                                 or isinstance(body.tool_choice, NamedToolChoice))


def forced_schema(body: ChatCompletionRequest) -> dict[str, Any]:
    """The JSON schema a forced tool call's output follows (see the module's docstring)."""
    if isinstance(body.tool_choice, NamedToolChoice):
        tool = next(t for t in body.tools if t.function.name == body.tool_choice.function.name)
        return tool.function.parameters or ANY_OBJECT
    choices = [{"type": "object", "properties": {
        "name": {"const": tool.function.name},
        "arguments": tool.function.parameters or ANY_OBJECT},
        "required": ["name", "arguments"], "additionalProperties": False}
        for tool in body.tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def parse_forced(text: str, body: ChatCompletionRequest) -> list[ParsedCall]:
    """The calls in a forced output ([] when it is cut short and does not parse)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if isinstance(body.tool_choice, NamedToolChoice):
        call = _call({"name": body.tool_choice.function.name, "arguments": value})
        return [call] if call else []
    return (_calls(value) or []) if isinstance(value, list) else []
