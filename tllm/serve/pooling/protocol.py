"""The wire format of the pooling and token routes: /v1/embeddings (OpenAI's), /v1/rerank and
/v2/rerank (Jina's and Cohere's), /v1/score, /tokenize and /detokenize (vLLM's). Requests are
validated as strictly as the generation routes' (tllm/serve/openai/protocol.py)."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, WithJsonSchema, field_validator, model_validator

from tllm.serve.openai.protocol import (ChatMessage, ChatTool, TokenIds, _Body,
                                        _is_prompt_list, _Response)

_TOKEN_IDS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_TEXTS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "string"}}
_INPUT_SCHEMA = {"anyOf": [
    {"type": "string"}, _TEXTS_SCHEMA, _TOKEN_IDS_SCHEMA,
    {"type": "array", "minItems": 1, "items": _TOKEN_IDS_SCHEMA}],
    "title": "Input", "description": "text, a list of texts, token ids, or a list of token "
    "id lists"}
_TEXT_OR_TEXTS_SCHEMA = {"anyOf": [{"type": "string"}, _TEXTS_SCHEMA]}


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PoolingUsage(_Response):
    prompt_tokens: int
    total_tokens: int = 0

    @model_validator(mode="after")
    def _total(self):
        self.total_tokens = self.prompt_tokens
        return self


# ---- /v1/embeddings ----

class EmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    model: Optional[str] = None
    input: Annotated[str | list[Any], WithJsonSchema(_INPUT_SCHEMA)]
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector as little-endian float32 bytes")
    dimensions: Optional[int] = Field(None, ge=1, description="keep the first this many "
                                      "dimensions (Matryoshka models), at most the model's")
    user: Optional[str] = Field(None, description="ignored")

    @field_validator("input")
    @classmethod
    def _input_form(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("the list is empty: send at least one input")
        if isinstance(value, str) or _is_prompt_list(value):
            return value
        raise ValueError("must be a string, a list of strings, a list of token ids, or a "
                         "list of lists of token ids")

    def inputs(self) -> list[str | TokenIds]:
        """The input as a list of inputs, each text or token ids."""
        value = self.input
        if isinstance(value, str) or all(isinstance(t, int) for t in value):
            return [value]
        return list(value)


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="the vector; with encoding_format "
                                         "base64, its little-endian float32 bytes in base64")


class EmbeddingResponse(_Response):
    id: str = Field(default_factory=lambda: new_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


# ---- /v1/rerank, /v2/rerank ----

class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    """POST /v1/rerank and /v2/rerank (Jina's and Cohere's shape)."""

    model: Optional[str] = None
    query: str
    documents: list[str | RerankDocument] = Field(
        min_length=1, description="texts, or objects with a `text`")
    top_n: Optional[int] = Field(None, ge=0, description="return the best this many (absent, "
                                 "null or 0: all)")
    return_documents: bool = True

    @field_validator("documents", mode="before")
    @classmethod
    def _document_form(cls, documents):
        for index, doc in enumerate(documents if isinstance(documents, list) else ()):
            if not (isinstance(doc, str) or isinstance(doc, dict)
                    and isinstance(doc.get("text"), str)):
                raise ValueError(f"document {index} is neither a string nor an object with "
                                 "a string `text`")
        return documents

    def texts(self) -> list[str]:
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


class RerankResultDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int
    relevance_score: float
    document: Optional[RerankResultDocument] = None


class RerankResponse(_Response):
    id: str = Field(default_factory=lambda: new_id("rerank"))
    model: str
    results: list[RerankResult] = Field(description="by relevance_score, the best first")
    usage: PoolingUsage


# ---- /v1/score ----

class ScoreRequest(_Body):
    """POST /v1/score (vLLM's): 1:1 and 1:N (text_1 one text, text_2 one or a list), or N:N
    (two lists of one length, scored pairwise)."""

    model: Optional[str] = None
    text_1: Annotated[str | list[str], WithJsonSchema(_TEXT_OR_TEXTS_SCHEMA)]
    text_2: Annotated[str | list[str], WithJsonSchema(_TEXT_OR_TEXTS_SCHEMA)]

    @field_validator("text_1", "text_2")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("the list is empty: send at least one text")
        return value


class ScoreData(_Response):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_Response):
    id: str = Field(default_factory=lambda: new_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


# ---- /tokenize, /detokenize ----

class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a `prompt`, or chat `messages` through the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = Field(
        None, description="prompt: add the tokenizer's special tokens (default true); "
        "messages: the template writes them")
    # the chat template's variables, as in /v1/chat/completions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ChatTool]] = None
    documents: Optional[list[dict[str, Any]]] = None

    @property
    def tool_choice(self) -> None:      # what chat's template_kwargs reads
        return None

    @property
    def reasoning_effort(self) -> None:
        return None

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens: with messages, the chat template writes "
                             "the special tokens")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's)."""

    model: Optional[str] = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(_Response):
    prompt: str
