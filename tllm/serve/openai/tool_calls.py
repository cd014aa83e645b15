"""What a tool call is, as the chat endpoint and the Responses API take it: a parsed call, a
call as far as it is written (streaming), the parser interface each model format implements
(tool_parsers.py, tool_parsers_code.py), and the forced calls. `tool_choice="required"` and a
named function: the output is constrained by a JSON schema (as vLLM does): a JSON array of
{"name", "arguments"} objects for required, the function's arguments object for a named one;
so those outputs are parsed the same way whatever the model's format."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tllm.serve.openai.protocol import (ChatCompletionRequest, FunctionCall, FunctionDefinition,
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


def call_of(obj: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    """A {"name", "arguments"} object as a call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except JSON_ERRORS:
            return None
    text = json_text(arguments) if isinstance(arguments, dict) else None
    return ParsedCall(obj["name"], text) if text is not None else None


def json_text(value: Any) -> str | None:
    """value as JSON text; None where JSON cannot hold it (NaN and infinities, which Python
    reads and writes but a client's JSON parser refuses; sets, bytes)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def calls_of(objs: list[Any], arguments_key: str = "arguments") -> list[ParsedCall] | None:
    calls = [call_of(obj, arguments_key) for obj in objs]
    return calls if calls and all(calls) else None


def tail_is_prefix(text: str, marker: str) -> int | None:
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

    def for_tools(self, functions: tuple[FunctionDefinition, ...]) -> ToolParser:
        """This parser for a request offering these functions (a format that writes
        arguments as text takes their types from the schemas)."""
        return self

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


class WholeCallsToolParser(ToolParser):
    """A format whose calls open with one of MARKERS and are streamed whole, once each is
    written (`_calls` reads the whole calls at the start of a text)."""

    MARKERS: tuple[str, ...] = ()

    def calls_start(self, text):
        found = [at for marker in self.MARKERS
                 if (at := tail_is_prefix(text, marker)) is not None]
        return min(found, default=None)

    def partial_calls(self, text):
        start = self.calls_start(text)
        calls = self._calls(text[start:]) if start is not None else []
        return [PartialCall(call.name, call.arguments, True) for call in calls]

    def _calls(self, text: str) -> list[ParsedCall]:
        raise NotImplementedError


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
        call = call_of({"name": tools.named, "arguments": value})
        return [call] if call else []
    return (calls_of(value) or []) if isinstance(value, list) else []


def forced_calls(text: str, tools: ToolRequest) -> list[ParsedCall]:
    """The calls of a whole forced output; cut short (by max_tokens), the calls as far as
    written, as OpenAI answers a cut call: its arguments as they are, finish_reason length.
    Never text: the grammar wrote calls, whole or not."""
    return parse_forced(text, tools) or [ParsedCall(call.name, call.arguments)
                                         for call in forced_partial_calls(text, tools)]


def forced_partial_calls(text: str, tools: ToolRequest) -> list[PartialCall]:
    """The calls of a forced output so far, for streaming their arguments as they come."""
    if tools.named is not None:
        return [PartialCall(tools.named, text, json_end(text, 0) is not None)] if text else []
    return scan_array(text, 0, names_alone=True)


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
_NAME_ALONE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_OBJECT_END = re.compile(r"\s*\}")
_SEMICOLON = re.compile(r"\s*;")


def _json_string(body: str) -> str | None:
    """The value of a JSON string's body (between its quotes); None if it does not parse."""
    try:
        return json.loads(f'"{body}"')
    except JSON_ERRORS:
        return None


def json_end(text: str, start: int) -> int | None:
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
    name, start = _json_string(match.group(1)), match.end()
    if name is None:
        return None
    if start == len(text):
        return PartialCall(name, "", False), None
    if text[start] != "{":   # arguments as a string: parsed when the output is whole
        return None
    end = json_end(text, start)
    if end is None:
        return PartialCall(name, text[start:], False), None
    closed = _OBJECT_END.match(text, end)
    return PartialCall(name, text[start:end], True), closed.end() if closed else None


def scan_array(text: str, at: int, names_alone: bool = False) -> list[PartialCall]:
    """The calls of a JSON array of call objects at text[at], as far as written.
    `names_alone`: a last call written up to its name counts (a grammar's output, where
    the arguments' object must follow)."""
    opened = re.compile(r"\s*\[").match(text, at)
    calls, at = [], opened.end() if opened else None
    while at is not None:
        scanned = scan_call(text, at)
        if scanned is None:
            named = _NAME_ALONE.match(text, at) if names_alone else None
            name = _json_string(named.group(1)) if named else None
            if name is not None:
                calls.append(PartialCall(name, "", False))
            break
        call, end = scanned
        calls.append(call)
        comma = re.compile(r"\s*,").match(text, end) if end is not None else None
        at = comma.end() if comma else None
    return calls
