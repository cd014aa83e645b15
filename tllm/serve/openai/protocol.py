"""The OpenAI-compatible wire format. Request bodies are validated strictly (no string-to-number
coercion, no NaN or infinity); unknown fields are kept aside for the server to ignore or refuse
(tllm/serve/openai/request_fields.py). Response bodies are plain models serialised as they are."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo,
                      WithJsonSchema, field_validator, model_validator)

from tllm.serve.openai.response_models import (  # noqa: F401 (re-exported)
    Usage, CompletionLogprobs, PromptLogprob, CompletionChoice, CompletionResponse,
    TopLogprob, ChatLogprob, ChoiceLogprobs, FunctionCall, ToolCall, AssistantMessage,
    ChatChoice, ChatCompletionResponse, DeltaFunctionCall, DeltaToolCall, DeltaMessage,
    ChatStreamChoice, ChatCompletionChunk, ModelCard, ModelList, ErrorInfo, ErrorResponse,
    HealthResponse, VersionResponse, _Response)

MAX_N = 128             # OpenAI's own cap on n (and on best_of)
# Top logprobs per position, completions `logprobs` and chat `top_logprobs` alike: OpenAI caps
# completions at 5 and chat at 20; 20 for both keeps evaluation harnesses that ask for more
# than 5 on completions working.
MAX_LOGPROBS = 20
MAX_STOP = 16           # stop strings per request
MAX_STOP_TOKEN_IDS = 256
# Seeds are signed 64-bit, as in OpenAI's schema; torch's manual_seed takes
# [-2**63, 2**64 - 1], so seed + sample index (< MAX_N) always fits.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions

TokenIds = list[int]
_TOKEN_IDS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
# What the prompt may be, for the schema; the validator below checks it with one message.
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
    _TOKEN_IDS_SCHEMA, {"type": "array", "minItems": 1, "items": _TOKEN_IDS_SCHEMA}],
    "title": "Prompt", "description": "text, a batch of texts, token ids, or a batch of "
    "token id lists"}


class _Body(BaseModel):
    # extra="allow": the server decides what unknown fields mean (ignored, as vLLM does, or
    # refused with --strict-request-fields); validation alone cannot, as it knows no server.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    """Options of a streamed response (`stream: true` only)."""

    include_usage: bool = False
    # vLLM's: usage in every chunk, not only in a last chunk of its own
    continuous_usage_stats: bool = False


class _SamplingRequest(_Body):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N, description=f"choices per prompt, at most {MAX_N}")
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[str | list[str]] = None
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX,
                                description="a signed 64-bit integer")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = Field(
        None, description="token id (a decimal string, within the vocabulary) -> bias in "
        "[-100, 100]")
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's extra sampling fields
    top_k: Optional[int] = Field(None, description="-1 or 0 (disabled), or 1 to the "
                                 "vocabulary size")
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="token ids within the vocabulary")
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's best-of and beam search fields (neither streams)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N, description="sequences generated, "
                                   "the n best returned; with use_beam_search the beam width")
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # vLLM's: lower runs first (the server's --scheduling-policy priority; else only 0)
    priority: int = 0
    # For RL trainers: which distribution logprobs report (SamplingParams.logprobs_mode),
    # and vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:<id>"
    logprobs_mode: Literal["raw_logprobs", "tempered_logprobs",
                           "processed_logprobs"] = "raw_logprobs"
    return_tokens_as_token_ids: bool = False
    # Disaggregated serving (set by `tllm serve disaggregated`'s front for its workers):
    # {"request_type": "context_only" | "generation_only", "ctx_request_id", "opaque_state"}
    disaggregated_params: Optional[dict[str, Any]] = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(stop)}")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options, info: ValidationInfo):
        if options is not None and not info.data.get("stream", False):
            raise ValueError("only allowed when stream is true")
        return options

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_stats(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Annotated[str | list[Any], WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: Optional[int] = Field(
        COMPLETIONS_DEFAULT_MAX_TOKENS, ge=0,
        description=f"absent or null: {COMPLETIONS_DEFAULT_MAX_TOKENS}, as OpenAI's")
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: each prompt token's logprob (and the top ones) in the choice, in the same call
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_form(cls, prompt):
        if isinstance(prompt, str) or _is_prompt_list(prompt):
            return prompt
        raise ValueError("must be a string, a list of strings, a list of token ids, or a "
                         "list of lists of token ids")

    @field_validator("max_tokens")
    @classmethod
    def _null_is_default(cls, max_tokens):
        return COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens

    def prompts(self) -> list[str | TokenIds]:
        """The prompt as a list of prompts, each text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or all(_is_token(t) for t in prompt):
            return [prompt]
        return list(prompt)


class TextPart(_Body):
    """One part of a message's content: text, or (below) an image."""

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_known(cls, part):
        if isinstance(part, dict) and part.get("type") not in ("text", "image_url"):
            raise ValueError(f"content parts are text or image_url, got type "
                             f"{part.get('type')!r}")
        return part


class ImageUrl(_Body):
    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImageUrlPart(_Body):
    """An image for a vision-language model: a base64 data: URL (file:// under
    --allowed-local-media-path; http(s) only from --allowed-media-domains)."""

    type: Literal["image_url"]
    image_url: ImageUrl


def _part_type(part) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "image_url" if kind == "image_url" else "text"


ContentPart = Annotated[Union[Annotated[TextPart, Tag("text")],
                              Annotated[ImageUrlPart, Tag("image_url")]],
                        Discriminator(_part_type)]


class FunctionCallIn(_Body):
    name: str
    arguments: str | dict[str, Any] = Field(
        description="a JSON object as a string (OpenAI's), or the object itself")


class ToolCallIn(_Body):
    """A tool call of an earlier assistant message in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[str | list[ContentPart]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None

    @model_validator(mode="after")
    def _content_where_needed(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with "
                             "tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if part.type == "text")

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.type == "image_url"
                                                      for p in self.content)


class JsonSchemaFormat(_Body):
    """response_format.json_schema: OpenAI's named schema."""

    model_config = ConfigDict(populate_by_name=True)
    name: str
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)   # vLLM's, as above
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Literal["none", "auto", "required"] | NamedToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    # vLLM's and trtllm-serve's chat template fields: the template's variables
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="end the prompt inside the last "
                                         "(assistant) message, for the model to continue it")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="more template variables, e.g. {\"enable_thinking\": false}")
    documents: Optional[list[dict[str, Any]]] = Field(
        None, description="documents for retrieval-augmented templates")
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = None
    # vLLM's guided decoding fields (at most one of them, checked when building the params)
    guided_json: Optional[dict[str, Any] | str] = None
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None
    guided_choice: Optional[list[str]] = Field(None, min_length=1)

    @model_validator(mode="after")
    def _tool_choice_among_tools(self):
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return self
        names = [tool.function.name for tool in self.tools or ()]
        if not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not "
                             "among the tools")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_prompt_list(prompt) -> bool:
    if not isinstance(prompt, list) or not prompt:
        return False
    return (all(_is_token(t) for t in prompt) or all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, list) and all(_is_token(t) for t in p) for p in prompt))
