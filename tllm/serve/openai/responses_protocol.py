"""OpenAI's Responses API wire format (POST /v1/responses): the request with its input items
and text format, validated as strictly as the other bodies (tllm/serve/openai/protocol.py), and the
response object, its output items and its usage as OpenAI's client reads them."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from tllm.serve.openai.protocol import _Body, _Response, _SamplingRequest


class InputTextPart(_Body):
    """A text part of an input message; `output_text` parts are earlier assistant turns sent
    back as they were returned (with their annotations and logprobs, ignored here)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, part):
        if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text",
                                                               "input_image"):
            raise ValueError(f"content parts are input_text, output_text or input_image, "
                             f"got type {part.get('type')!r}")
        return part


class InputImagePart(_Body):
    """An image for a vision-language model: `image_url` a base64 data: URL (file://
    under --allowed-local-media-path; http(s) only from --allowed-media-domains)."""

    type: Literal["input_image"]
    image_url: str
    detail: Optional[Literal["auto", "low", "high"]] = None


def _part_type(part) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "input_image" if kind == "input_image" else "text"


InputPart = Annotated[Union[Annotated[InputTextPart, Tag("text")],
                            Annotated[InputImagePart, Tag("input_image")]],
                      Discriminator(_part_type)]


class MessageItem(_Body):
    """A message: `{role, content}` (the type may be left out, as OpenAI allows)."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputPart]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if part.type != "input_image")

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "input_image"
                                                      for p in self.content)

    def template_content(self) -> str | list[dict]:
        """The content as chat templates take it (with images: parts, as chat's)."""
        if not self.has_images:
            return self.text()
        return [{"type": "image_url", "image_url": {"url": part.image_url}}
                if part.type == "input_image" else {"type": "text", "text": part.text}
                for part in self.content]


class FunctionCallItem(_Body):
    """A function call the model made in an earlier turn, sent back as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Body):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: Optional[str] = None
    status: Optional[str] = None


InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem],
                      Field(discriminator="type")]


class FunctionTool(_Body):
    """A function the model may call (`{"type": "function", "name", "parameters", ...}`)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    @model_validator(mode="before")
    @classmethod
    def _only_functions(cls, tool):
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise ValueError(f"only function tools are supported, got type "
                             f"{tool.get('type')!r}")
        return tool


class FunctionToolChoice(_Body):
    """tool_choice naming the one function the model must call."""

    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """`text.format`: plain text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and (self.json_schema is None or not self.name):
            raise ValueError("a json_schema format needs a name and a schema")
        return self


class TextConfig(_Body):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ResponsesRequest(_SamplingRequest):
    """POST /v1/responses (vLLM's extra sampling fields are accepted as on the other
    endpoints; one output per request)."""

    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1, description="always 1: a response has one output")
    store: bool = True
    previous_response_id: Optional[str] = None
    text: Optional[TextConfig] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Literal["none", "auto", "required"] | FunctionToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    truncation: Optional[Literal["disabled"]] = None
    # extra output data to include (search results, encrypted reasoning...): this server
    # has none of those tools, so there is nothing to add (OpenAI's clients send [])
    include: Optional[list[str]] = None

    @field_validator("input", mode="before")
    @classmethod
    def _typed_items(cls, items):
        """Messages given as bare `{role, content}` get their type, so the union can pick."""
        if isinstance(items, list):
            return [{"type": "message", **item}
                    if isinstance(item, dict) and "type" not in item and "role" in item
                    else item for item in items]
        return items

    @model_validator(mode="after")
    def _tool_choice_among_tools(self):
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return self
        names = [tool.name for tool in self.tools or ()]
        if not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, FunctionToolChoice) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the "
                             "tools")
        return self


# ---- responses ----

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_id("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(_Response):
    """A call the model made: the client runs it and sends back a function_call_output."""

    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_id("fc"))
    call_id: str
    name: str
    arguments: str      # a JSON object as text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Union[OutputMessage, OutputFunctionCall]


class ResponseUsage(_Response):
    input_tokens: int
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = Field(
        default_factory=lambda: {"reasoning_tokens": 0})

    @model_validator(mode="after")
    def _total(self):
        self.total_tokens = self.input_tokens + self.output_tokens
        return self


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(_Response):
    """A response as OpenAI's `Response` (what the request asked for, echoed back)."""

    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    incomplete_details: Optional[IncompleteDetails] = None
    error: Optional[dict[str, Any]] = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Optional[ResponseUsage] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[Any] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    metadata: Optional[dict[str, str]] = None
    truncation: str = "disabled"
