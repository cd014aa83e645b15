"""The tool-call formats that write arguments as code rather than JSON: Qwen3-Coder's XML
parameters and the pythonic call list of Llama 3.2 / 4. Each call is sent, whole, once it
is written; an output whose calls do not parse is all content."""
from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from dataclasses import dataclass
from typing import Any

from tllm.serve.openai.protocol import FunctionDefinition
from tllm.serve.openai.tool_calls import (JSON_ERRORS, ParsedCall, PartialCall, ToolParser,
                                          WholeCallsToolParser, json_text, tail_is_prefix)


@dataclass(frozen=True)
class Qwen3CoderToolParser(WholeCallsToolParser):
    """Qwen3-Coder: `<tool_call><function=NAME><parameter=ARG>value</parameter>...
    </function></tool_call>` after any text. Values are text: the offered function's schema
    says which are numbers, booleans, objects (`functions`, given per request)."""

    name = "qwen3_coder"
    functions: tuple[FunctionDefinition, ...] = ()
    MARKERS = ("<tool_call>", "<function=")
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)",
                            re.DOTALL)

    def for_tools(self, functions):
        return Qwen3CoderToolParser(tuple(functions))

    def parse(self, text):
        start = self.calls_start(text)
        if start is None:
            return text, []
        calls = self._calls(text[start:])
        if not calls or len(calls) != text.count("<function=", start):
            return text, []     # no call, or one left open or malformed
        return (text[:start].strip() or None), calls

    def _calls(self, text: str) -> list[ParsedCall]:
        """The whole calls in text, up to the first that does not parse."""
        calls = []
        for match in self._FUNCTION.finditer(text):
            name = match.group(1).strip()
            properties = self._properties(name)
            arguments = json_text({
                key.strip(): _typed(_unwrapped(value), properties.get(key.strip()))
                for key, value in self._PARAMETER.findall(match.group(2))})
            if arguments is None:
                break
            calls.append(ParsedCall(name, arguments))
        return calls

    def _properties(self, name: str) -> dict[str, Any]:
        for function in self.functions:
            if function.name == name and isinstance(function.parameters, dict):
                properties = function.parameters.get("properties")
                return properties if isinstance(properties, dict) else {}
        return {}


def _unwrapped(value: str) -> str:
    """A parameter's text less the one line break the format puts on each side."""
    return value.removeprefix("\n").removesuffix("\n")


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema asks for; text where it says string, or
    where the text is not such a value. Without a schema: JSON if it is JSON, else text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"     # Python's True as well as JSON's true
    try:
        return json.loads(value)
    except JSON_ERRORS:
        pass
    if kind in ("object", "array"):     # some models write Python literals here
        try:
            return ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return value


class _NotACall(ValueError):
    """Python that is not a list of calls with literal keyword arguments."""


class PythonicToolParser(ToolParser):
    """Llama 3.2 / Llama 4 pythonic calls: the whole output is a Python list of calls,
    `[get_weather(city="Paris"), get_time()]` (Llama 4 between `<|python_start|>` and
    `<|python_end|>`). Read with Python's ast (literal arguments only, never evaluated)."""

    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"
    _OPENING = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")

    def parse(self, text):
        calls = self._parse_list(self._body(text)[1])
        return (None, calls) if calls else (text, [])

    def calls_start(self, text):
        at, body = self._body(text)
        if not body or body.startswith(("[", self.START)) or self.START.startswith(body):
            return at
        return None

    def partial_calls(self, text):
        body = self._body(text)[1]
        if ")" not in body or not self._OPENING.match(body):
            return []   # no call has closed, or this is no list of calls (cheap checks first)
        ends = _closed_call_ends(body)
        calls = self._parse_list(body[:ends[-1]] + "]") if ends else []
        return [PartialCall(call.name, call.arguments, True) for call in calls]

    def _body(self, text: str) -> tuple[int, str]:
        """(where the calls may start, the list's text: no markers, no outer whitespace)."""
        body = text.lstrip()
        at = len(text) - len(body)
        return at, body.removeprefix(self.START).strip().removesuffix(self.END).strip()

    @staticmethod
    def _parse_list(body: str) -> list[ParsedCall]:
        """The calls of a Python list of calls ([] for anything else)."""
        if not body.startswith("["):
            return []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return []
            return [_parsed_call(node) for node in tree.elts]
        except (_NotACall, SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return []


def _parsed_call(node: ast.expr) -> ParsedCall:
    """`name(key=literal, ...)` as a call; _NotACall for any other expression."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        raise _NotACall("not a call of a function name with keyword arguments")
    if any(keyword.arg is None for keyword in node.keywords):   # f(**kwargs)
        raise _NotACall("** arguments")
    arguments = json_text({keyword.arg: ast.literal_eval(keyword.value)
                           for keyword in node.keywords})
    if arguments is None:   # a set, bytes, NaN: no JSON value
        raise _NotACall("arguments JSON cannot hold")
    return ParsedCall(node.func.id, arguments)


def _closed_call_ends(body: str) -> list[int]:
    """Where each call of a list of calls being written closes (offsets just past its `)`),
    found with Python's tokenizer so that brackets inside strings do not count."""
    line_starts = [0]
    for line in io.StringIO(body):
        line_starts.append(line_starts[-1] + len(line))
    ends, depth = [], 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(body).readline):
            if token.type == tokenize.ERRORTOKEN:   # an open string: stop before it
                break
            if token.type != tokenize.OP:
                continue
            if token.string in "([{":
                depth += 1
            elif token.string in ")]}":
                depth -= 1
                if depth == 1 and token.string == ")":
                    row, column = token.end
                    ends.append(line_starts[row - 1] + column)
    except (tokenize.TokenError, SyntaxError):  # the text so far ends inside a bracket
        pass
    return ends
