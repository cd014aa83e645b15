"""Reasoning output (`--reasoning-parser`): a model's `<think>...</think>` split from its answer
into `reasoning_content`, whole or as streamed deltas; guided decoding waits for `</think>`."""
from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """How a model marks its reasoning. `starts_thinking`: the chat template already wrote
    `<think>` into the prompt (DeepSeek-R1), so the output is reasoning until `</think>`
    even without its start tag; otherwise (Qwen3) an output without `<think>` is all answer."""

    name: str
    starts_thinking: bool

    def split(self, text: str, is_final: bool = True) -> tuple[str, str]:
        """(reasoning, content) of the text so far. Not final: a tail that may be the start of
        a tag is in neither (it is decided when more text comes)."""
        body = text.lstrip()
        if not is_final and THINK_START.startswith(body):
            return "", ""   # maybe the start tag, not yet whole
        if body.startswith(THINK_START):
            body = body[len(THINK_START):]
        elif not self.starts_thinking:
            return "", text
        reasoning, end, content = body.partition(THINK_END)
        if end:
            return reasoning, content.lstrip()
        if not is_final:
            reasoning = _without_tag_prefix(reasoning, THINK_END)
        return reasoning, ""


def _without_tag_prefix(text: str, tag: str) -> str:
    """text less a tail that is the start of tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
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


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", starts_thinking=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_thinking=True),
}


def after_reasoning(guided: tuple[str, dict] | None,
                    parser: str | None) -> tuple[str, dict] | None:
    """A guided request (params.guided_request's answer) whose grammar waits for the
    reasoning to end, when the server splits reasoning."""
    if guided is None or parser is None:
        return guided
    field, keywords = guided
    return field, {**keywords, "reasoning_tags": (THINK_START, THINK_END)}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called name (None: no reasoning split); ValueError naming the choices."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                         f"got {name!r}")
    return REASONING_PARSERS[name]
