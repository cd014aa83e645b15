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

from tllm.serve.protocol import (ChatCompletionRequest, FunctionCall, FunctionDefinition,
                                 NamedToolChoice, ToolCall)

# What json.loads raises for text that is not a JSON value it can hold: JSONDecodeError, a
# ValueError for an integer past Python's 4,300 digits, RecursionError for deep nesting (a
# client's text or a model's output may be any of these)
JSON_ERRORS = (ValueError, RecursionError)

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
        except JSON_ERRORS:
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

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls written so far, for streaming (the ones not written name first are
        sent when the output is whole)."""
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
        except JSON_ERRORS:
            return text, []
        calls = _calls(objs)
        if calls is None:
            return text, []
        return (text[:start].strip() or None), calls

    def calls_start(self, text):
        return _tail_is_prefix(text, self.START)

    def partial_calls(self, text):
        calls, at = [], text.find(self.START)
        while at != -1:
            scanned = scan_call(text, at + len(self.START))
            if scanned is None:
                break
            calls.append(scanned[0])
            at = text.find(self.START, at + len(self.START))
        return calls


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
        except JSON_ERRORS:
            return text, []
        calls = _calls(objs, arguments_key="parameters")
        return (None, calls) if calls else (text, [])

    def calls_start(self, text):
        body = text.lstrip()
        if not body or body.startswith(("{", self.TAG)) or self.TAG.startswith(body):
            return len(text) - len(body)
        return None

    def partial_calls(self, text):
        body = text.lstrip()
        at = len(text) - len(body) + (len(self.TAG) if body.startswith(self.TAG) else 0)
        calls = []
        while (scanned := scan_call(text, at)) is not None:
            calls.append(scanned[0])
            separator = _SEMICOLON.match(text, scanned[1]) if scanned[1] is not None else None
            if separator is None:
                break
            at = separator.end()
        return calls


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
        except JSON_ERRORS:
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

    def partial_calls(self, text):
        start = text.find(self.START)
        return _scan_array(text, start + len(self.START) if start != -1 else 0)


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


@dataclass(frozen=True)
class ToolRequest:
    """The tools a request offers and how it chooses among them, as chat completions and
    the Responses API both ask: `choice` none | auto | required | None, or `named`."""

    functions: tuple[FunctionDefinition, ...]
    choice: str | None = None
    named: str | None = None            # tool_choice names this function
    parallel: bool | None = None

    @classmethod
    def of_chat(cls, body: ChatCompletionRequest) -> ToolRequest:
        named = body.tool_choice if isinstance(body.tool_choice, NamedToolChoice) else None
        return cls(tuple(tool.function for tool in body.tools or ()),
                   None if named else body.tool_choice,
                   named.function.name if named else None, body.parallel_tool_calls)

    @property
    def is_auto(self) -> bool:
        """The model may call a tool in its own format (or answer in text)."""
        return bool(self.functions) and self.named is None and self.choice in (None, "auto")

    @property
    def is_forced(self) -> bool:
        """The request must call a tool: tool_choice required or a named function."""
        return bool(self.functions) and (self.choice == "required" or self.named is not None)


def forced_schema(tools: ToolRequest) -> dict[str, Any]:
    """The JSON schema a forced tool call's output follows (see the module's docstring)."""
    if tools.named is not None:
        function = next(f for f in tools.functions if f.name == tools.named)
        return function.parameters or ANY_OBJECT
    choices = [{"type": "object", "properties": {
        "name": {"const": function.name},
        "arguments": function.parameters or ANY_OBJECT},
        "required": ["name", "arguments"], "additionalProperties": False}
        for function in tools.functions]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if tools.parallel is False:
        schema["maxItems"] = 1
    return schema


def parse_forced(text: str, tools: ToolRequest) -> list[ParsedCall]:
    """The calls in a forced output ([] when it is cut short and does not parse)."""
    try:
        value = json.loads(text)
    except JSON_ERRORS:
        return []
    if tools.named is not None:
        call = _call({"name": tools.named, "arguments": value})
        return [call] if call else []
    return (_calls(value) or []) if isinstance(value, list) else []


def forced_partial_calls(text: str, tools: ToolRequest) -> list[PartialCall]:
    """The calls of a forced output so far, for streaming their arguments as they come."""
    if tools.named is not None:
        return [PartialCall(tools.named, text, _json_end(text, 0) is not None)] if text else []
    return _scan_array(text, 0)


# ---- the calls of a partial output (streaming) ----

@dataclass(frozen=True)
class PartialCall:
    """A call as far as it is written: its name, and its arguments' raw text so far."""

    name: str
    arguments: str
    is_complete: bool


# A call object written name first: {"name": "...", "arguments": (its object follows)
_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
                         r'"(?:arguments|parameters)"\s*:\s*')
_OBJECT_END = re.compile(r"\s*\}")
_SEMICOLON = re.compile(r"\s*;")


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at text[start] closes (None: not yet)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_call(text: str, at: int) -> tuple[PartialCall, int | None] | None:
    """The call object at text[at] so far and where it ends (None while open); None when the
    text there is not (yet) a call written name first with an object of arguments."""
    match = _NAME_FIRST.match(text, at)
    if match is None:
        return None
    name, start = json.loads(f'"{match.group(1)}"'), match.end()
    if start == len(text):
        return PartialCall(name, "", False), None
    if text[start] != "{":   # arguments as a string: parsed when the output is whole
        return None
    end = _json_end(text, start)
    if end is None:
        return PartialCall(name, text[start:], False), None
    closed = _OBJECT_END.match(text, end)
    return PartialCall(name, text[start:end], True), closed.end() if closed else None


def _scan_array(text: str, at: int) -> list[PartialCall]:
    """The calls of a JSON array of call objects at text[at], as far as written."""
    opened = re.compile(r"\s*\[").match(text, at)
    calls, at = [], opened.end() if opened else None
    while at is not None:
        scanned = scan_call(text, at)
        if scanned is None:
            break
        call, end = scanned
        calls.append(call)
        comma = re.compile(r"\s*,").match(text, end) if end is not None else None
        at = comma.end() if comma else None
    return calls
