"""How a choice's text becomes an answer, for chat completions and the Responses API alike:
reasoning split off (`--reasoning-parser`), tool calls parsed (`auto`: the model's format by
`--tool-call-parser`; `required` / a named function: the grammar's JSON), whole or streamed.
Streamed calls go out as they are written: a call's name once it is whole, then its
arguments piece by piece (OpenAI's tool-call deltas); formats that write arguments as code,
or not name first, send a call whole. A forced answer cut short is still calls, never text."""
from __future__ import annotations

from dataclasses import dataclass, field

from tllm.serve.openai.reasoning import ReasoningParser, ReasoningStream
from tllm.serve.openai.tool_calls import (ParsedCall, PartialCall, ToolParser, ToolRequest,
                                   forced_calls, forced_partial_calls, new_call_id)


@dataclass(frozen=True)
class OutputFormat:
    """What to take out of a choice's text. `parser`: the model's own call format, used
    when the tools are `auto`; `tools`: the request's tools (None: plain text)."""

    reasoning: ReasoningParser | None = None
    parser: ToolParser | None = None
    tools: ToolRequest | None = None

    @classmethod
    def of(cls, reasoning: ReasoningParser | None, parser: ToolParser | None,
           tools: ToolRequest | None) -> OutputFormat:
        takes_calls = tools is not None and (tools.is_forced
                                             or (tools.is_auto and parser is not None))
        if not (takes_calls and tools.is_auto):
            parser = None
        return cls(reasoning, parser.for_tools(tools.functions) if parser else None,
                   tools if takes_calls else None)

    @property
    def is_forced(self) -> bool:
        return self.tools is not None and self.tools.is_forced

    @property
    def takes_calls(self) -> bool:
        return self.tools is not None

    def split(self, text: str) -> tuple[str | None, str | None, list[ParsedCall]]:
        """(reasoning, content, calls) of a whole choice."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        content, calls = self.calls(content)
        return reasoning or None, content, calls

    def calls(self, content: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of the answer after any reasoning (a forced answer has no
        content: it is calls, whole or cut short)."""
        if self.is_forced:
            return None, forced_calls(content, self.tools)
        if self.parser is not None:
            return self.parser.parse(content)
        return content, []

    def partial_calls(self, content: str) -> list[PartialCall]:
        if self.is_forced:
            return forced_partial_calls(content, self.tools)
        return self.parser.partial_calls(content) if self.parser is not None else []

    def content_end(self, content: str) -> int:
        """How much of the content so far may be sent as text before the choice ends."""
        if self.is_forced:
            return 0
        if self.parser is not None:
            start = self.parser.calls_start(content)
            return len(content) if start is None else start
        return len(content)


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


@dataclass(frozen=True)
class CallDelta:
    """A piece of the call at `index`: its first piece has the id and the name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class StreamUpdate:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _SentCall:
    id: str
    name: str
    num_arguments_sent: int = 0


class ChoiceStream:
    """One streamed choice: text deltas in, StreamUpdates out. Content that may be a call is
    held back; a call goes out from the moment its name is written; at the end, calls that
    could only be parsed whole go out whole, and held content that was no call is sent."""

    def __init__(self, output: OutputFormat) -> None:
        self.output = output
        self.reasoning = ReasoningStream(output.reasoning) if output.reasoning else None
        self.content = ""
        self.num_content_sent = 0
        self.sent_calls: list[_SentCall] = []

    def add(self, text: str, reason: str | None) -> StreamUpdate:
        is_final = reason is not None
        reasoning, content = (self.reasoning.add(text, is_final) if self.reasoning
                              else ("", text))
        self.content += content
        calls: list[CallDelta] = []
        if self.output.takes_calls:
            calls = self._call_deltas(self.output.partial_calls(self.content))
            if is_final:
                calls += self._final_call_deltas(self.output.calls(self.content)[1])
        end = self.output.content_end(self.content)
        if is_final and not self.sent_calls and not self.output.is_forced:
            end = len(self.content)     # no call after all: the held text was content
        new_content = self.content[self.num_content_sent:end]
        self.num_content_sent = max(self.num_content_sent, end)
        return StreamUpdate(reasoning, new_content, calls,
                            finish_reason(reason, bool(self.sent_calls)))

    def _call_deltas(self, partial: list[PartialCall]) -> list[CallDelta]:
        deltas = []
        for index, call in enumerate(partial):
            if index == len(self.sent_calls):
                self.sent_calls.append(_SentCall(new_call_id(), call.name))
                deltas.append(CallDelta(index, "", self.sent_calls[index].id, call.name))
            sent = self.sent_calls[index]
            piece = call.arguments[sent.num_arguments_sent:]
            if piece:
                sent.num_arguments_sent = len(call.arguments)
                deltas.append(CallDelta(index, piece))
        return deltas

    def _final_call_deltas(self, calls: list[ParsedCall]) -> list[CallDelta]:
        """Calls the whole output has beyond those streamed (written arguments first, or as a
        string), whole."""
        deltas = []
        for index in range(len(self.sent_calls), len(calls)):
            call = calls[index]
            self.sent_calls.append(_SentCall(new_call_id(), call.name, len(call.arguments)))
            deltas.append(CallDelta(index, call.arguments, self.sent_calls[index].id,
                                    call.name))
        return deltas
