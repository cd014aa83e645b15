"""Reasoning output (`--reasoning-parser`): a model's thinking split from its answer into
`reasoning_content`, whole or as streamed deltas. `<think>...</think>` (qwen3, deepseek_r1,
think), Granite's "Here is my thought process:" ... "Here is my response:", and gpt-oss's
harmony channels (analysis, then final). Guided decoding waits for `</think>`; with the
others (no one-token end of the reasoning) the grammar applies from the first token."""
from __future__ import annotations

from dataclasses import dataclass, replace

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    """How a model marks its reasoning. split() must only grow as the text grows (the
    streamed deltas are its differences)."""

    name = ""
    # (start, end) of the reasoning as one token each: guided decoding's gate waits for them
    reasoning_tags: tuple[str, str] | None = None
    needs_special_tokens = False    # the marks are special tokens: decode them into the text
    reads_prompt = False            # for_prompt() tells this parser more

    def split(self, text: str, is_final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of the text so far. Not final: a tail that may be the start of
        a mark is in neither (it is decided when more text comes)."""
        raise NotImplementedError

    def for_prompt(self, prompt_tail: str) -> ReasoningParser:
        """This parser for a request whose prompt ends with prompt_tail (its last tokens)."""
        return self


@dataclass(frozen=True)
class DelimitedReasoningParser(ReasoningParser):
    """Reasoning between a start mark and an end mark, at the start of the output.
    `starts_thinking`: the chat template already wrote the start into the prompt
    (DeepSeek-R1), so the output is reasoning until the end mark even without its start;
    otherwise (Qwen3) an output that does not open with a start mark is all answer.
    `reads_prompt`: starts_thinking is read from each prompt (the `think` parser)."""

    name: str
    starts: tuple[str, ...] = (THINK_START,)
    ends: tuple[str, ...] = (THINK_END,)
    starts_thinking: bool = False
    reads_prompt: bool = False
    reasoning_tags: tuple[str, str] | None = None

    def split(self, text: str, is_final: bool = True) -> tuple[str, str]:
        body = text.lstrip()
        if not is_final and any(start.startswith(body) for start in self.starts):
            return "", ""   # maybe a start mark, not yet whole
        start = next((s for s in self.starts if body.startswith(s)), None)
        if start is not None:
            body = body[len(start):]
        elif not self.starts_thinking:
            return "", text
        reasoning, end, content = _partition_first(body, self.ends)
        if end:
            return reasoning, content.lstrip()
        if not is_final:
            reasoning = _without_tag_prefix(reasoning, self.ends)
        return reasoning, ""

    def for_prompt(self, prompt_tail: str) -> ReasoningParser:
        if not self.reads_prompt:
            return self
        opened = prompt_tail.rfind(self.starts[0]) > prompt_tail.rfind(self.ends[0])
        return replace(self, starts_thinking=opened)


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss (OpenAI's harmony format): `<|channel|>analysis<|message|>...<|end|>` is
    reasoning; `<|start|>assistant<|channel|>final<|message|>...` (ended by `<|return|>`) the
    answer, as is a commentary message's text. The marks are special tokens, so the server
    decodes them for this parser. An output that does not open with a channel is all answer.
    (Harmony's tool calls, `to=functions.NAME` messages, are not parsed into tool_calls.)"""

    name = "gpt_oss"
    needs_special_tokens = True
    CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
    ENDS = ("<|end|>", "<|return|>", "<|call|>")

    def split(self, text: str, is_final: bool = True) -> tuple[str, str]:
        body = text.lstrip()
        if not is_final and self.CHANNEL.startswith(body):
            return "", ""
        if not body.startswith(self.CHANNEL):
            return "", text
        reasoning, content, at = [], [], 0
        while (channel := body.find(self.CHANNEL, at)) != -1:
            message = body.find(self.MESSAGE, channel)
            if message == -1:
                break       # the header is not whole yet
            header = body[channel + len(self.CHANNEL):message].split()
            start = message + len(self.MESSAGE)
            text_of, end, _ = _partition_first(body[start:], self.ENDS)
            if not end and not is_final:
                text_of = _without_tag_prefix(text_of, self.ENDS)
            (reasoning if header[:1] == ["analysis"] else content).append(text_of)
            if not end:
                break
            at = start + len(text_of) + len(end)
        return "".join(reasoning), "".join(content)


def _partition_first(text: str, marks: tuple[str, ...]) -> tuple[str, str, str]:
    """str.partition at the first of several marks."""
    found = [(at, mark) for mark in marks if (at := text.find(mark)) != -1]
    if not found:
        return text, "", ""
    at, mark = min(found)
    return text[:at], mark, text[at + len(mark):]


def _without_tag_prefix(text: str, tags: tuple[str, ...]) -> str:
    """text less its longest tail that is the start of one of the tags."""
    for size in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-size:]) for tag in tags):
            return text[:-size]
    return text


class ReasoningStream:
    """One streamed choice: text deltas in, (reasoning delta, content delta) out."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent_reasoning = self._sent_content = 0

    def add(self, delta: str, is_final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.split(self.text, is_final)
        # The split only grows: the reasoning ends before any content is decided.
        new_reasoning = reasoning[self._sent_reasoning:]
        new_content = content[self._sent_content:]
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        self._sent_content = max(self._sent_content, len(content))
        return new_reasoning, new_content


_THINK_TAGS = (THINK_START, THINK_END)
REASONING_PARSERS: dict[str, ReasoningParser] = {parser.name: parser for parser in (
    DelimitedReasoningParser("qwen3", reasoning_tags=_THINK_TAGS),
    DelimitedReasoningParser("deepseek_r1", starts_thinking=True, reasoning_tags=_THINK_TAGS),
    # either of those, told by the prompt: thinking if it ends with an open <think>
    DelimitedReasoningParser("think", reads_prompt=True, reasoning_tags=_THINK_TAGS),
    DelimitedReasoningParser("granite", starts=("Here is my thought process:",
                                                "Here's my thought process:"),
                             ends=("Here is my response:", "Here's my response:")),
    GptOssReasoningParser(),
)}


def after_reasoning(guided: tuple[str, dict] | None,
                    parser: ReasoningParser | None) -> tuple[str, dict] | None:
    """A guided request (params.guided_request's answer) whose grammar waits for the
    reasoning to end, when the server splits reasoning marked by one-token tags."""
    if guided is None or parser is None or parser.reasoning_tags is None:
        return guided
    field, keywords = guided
    return field, {**keywords, "reasoning_tags": parser.reasoning_tags}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called name (None: no reasoning split); ValueError naming the choices."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                         f"got {name!r}")
    return REASONING_PARSERS[name]
