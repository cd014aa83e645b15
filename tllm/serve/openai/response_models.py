"""The OpenAI-compatible response bodies: plain models serialised as they are (the
request side, validated strictly, is tllm/serve/openai/protocol.py, which re-exports
these)."""
from __future__ import annotations

import time
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


def _now() -> int:
    return int(time.time())


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0

    @model_validator(mode="after")
    def _total(self):
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        return self


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """One token of a prompt position (vLLM's prompt_logprobs entry)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: str


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    # per prompt position (the first: null), token id -> its logprob (prompt_logprobs asked)
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprob]]]] = None


class CompletionResponse(_Response):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: Optional[list[ChatLogprob]] = None


class FunctionCall(_Response):
    name: str
    arguments: str      # a JSON object as text, as OpenAI's


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


class ChatCompletionResponse(_Response):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's: the templated prompt's positions (the first: null), prompt_logprobs asked
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprob]]]] = None


class DeltaFunctionCall(_Response):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Response):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


class ChatCompletionChunk(_Response):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


class ModelCard(_Response):
    id: str
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tllm"
    root: Optional[str] = None
    parent: Optional[str] = None   # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: str = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Response):
    error: ErrorInfo


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"


class VersionResponse(_Response):
    version: str
