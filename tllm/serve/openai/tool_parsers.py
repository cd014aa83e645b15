"""The tool-call formats whose arguments are JSON (`--tool-call-parser`), and the registry
of every format (those that write arguments as code are in tool_parsers_code.py). Parsers
take the text after any reasoning; an output whose calls do not parse is all content."""
from __future__ import annotations

import json
import re

from tllm.serve.openai.tool_calls import (JSON_ERRORS, ParsedCall, PartialCall, ToolParser,
                                          WholeCallsToolParser, call_of, calls_of, scan_array,
                                          scan_call, tail_is_prefix)
from tllm.serve.openai.tool_parsers_code import PythonicToolParser, Qwen3CoderToolParser

_SEMICOLON = re.compile(r"\s*;")


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
        calls = calls_of(objs)
        if calls is None:
            return text, []
        return (text[:start].strip() or None), calls

    def calls_start(self, text):
        return tail_is_prefix(text, self.START)

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
        calls = calls_of(objs, arguments_key="parameters")
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
        calls = calls_of(objs if isinstance(objs, list) else [objs])
        if calls is None:
            return text, []
        return (text[:start].strip() or None) if start != -1 else None, calls

    def calls_start(self, text):
        found = tail_is_prefix(text, self.START)
        if found is not None:
            return found
        body = text.lstrip()
        return len(text) - len(body) if "[{".startswith(body[:2]) else None

    def partial_calls(self, text):
        start = text.find(self.START)
        return scan_array(text, start + len(self.START) if start != -1 else 0)



class DeepSeekV3ToolParser(WholeCallsToolParser):
    """DeepSeek-V3: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME` and the arguments in a ```json block, `<｜tool▁call▁end｜>`; V3.1's
    `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` too. (The bars and the
    underscore-like marks are the fullwidth ｜ and ▁ of DeepSeek's special tokens.) A call
    is sent once it is whole."""

    name = "deepseek_v3"
    CALLS_BEGIN, CALL_BEGIN = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"
    MARKERS = (CALLS_BEGIN, CALL_BEGIN)
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>",
                       re.DOTALL)
    _NAME_AND_BLOCK = re.compile(r"\s*([^\n`]+?)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)

    def parse(self, text):
        start = self.calls_start(text)
        if start is None:
            return text, []
        calls = self._calls(text[start:])
        if not calls or len(calls) != text.count(self.CALL_BEGIN, start):
            return text, []     # no call, or one left open or malformed
        return (text[:start].strip() or None), calls

    def _calls(self, text: str) -> list[ParsedCall]:
        """The whole calls in text, up to the first that does not parse."""
        calls = []
        for match in self._CALL.finditer(text):
            head, body = match.group(1).strip(), match.group(2)
            block = self._NAME_AND_BLOCK.fullmatch(body)
            name, arguments = (block.group(1), block.group(2)) if block else (head, body)
            try:
                call = call_of({"name": name.strip(), "arguments": json.loads(arguments)})
            except JSON_ERRORS:
                call = None
            if call is None:
                break
            calls.append(call)
        return calls


TOOL_PARSERS = {parser.name: parser for parser in
                (HermesToolParser(), Llama3JsonToolParser(), MistralToolParser(),
                 DeepSeekV3ToolParser(), Qwen3CoderToolParser(), PythonicToolParser())}


def tool_parser(name: str | None) -> ToolParser | None:
    """The parser called name (None: `auto` gives plain text); ValueError naming the choices."""
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, "
                         f"got {name!r}")
    return TOOL_PARSERS[name]
