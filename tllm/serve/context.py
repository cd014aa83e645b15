"""The server's configuration and the state its endpoints share."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from tllm.serve.http.errors import APIError, bad_request, internal_error
from tllm.lora.request import LoRARequest
from tllm.serve.openai.generation import (DEFAULT_MAX_SEQUENCES, EngineClient, Generation,
                                   abort_on_disconnect)
from tllm.serve.openai.image_input import DEFAULT_MAX_IMAGE_PIXELS
from tllm.serve.http.limits import HttpLimits
from tllm.serve.openai.logprobs import LogprobFormatter
from tllm.serve.lora import LoraRegistry
from tllm.serve.http.metrics import ServerMetrics
from tllm.serve.openai.protocol import Usage
from tllm.serve.http.supervisor import EngineSupervisor, RestartPolicy

logger = logging.getLogger(__name__)
SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ServerConfig:
    """How the server behaves around the engine (the engine's own settings are LLM args)."""

    model: str = "smollm2"
    served_model_name: str | None = None
    api_key: str | None = None
    max_queue_size: int | None = 1024
    max_sequences_per_request: int | None = DEFAULT_MAX_SEQUENCES  # prompts x n (x best_of)
    max_body_bytes: int = 16 << 20
    chat_template: str | None = None
    stuck_timeout_s: float = 120.0
    image_url_ttl_s: float = 3600.0     # images server: how long "url" files stay
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # visual servers: larger inputs get 400
    body_read_timeout_s: float = 10.0   # 408 when a body has not all arrived by then
    max_header_bytes: int = 16 << 10    # uvicorn/h11: larger request heads get a 400
    keep_alive_timeout_s: float = 5.0   # connections without a request closed after
    header_read_timeout_s: float = 10.0     # 408 when a head has not all arrived by then
    max_connections: int = 1024         # open connections (http_server.ConnectionGuard)
    protect_metrics: bool = False       # with api_key: /metrics and the docs need it too
    exit_on_engine_failure: bool = False    # exit non-zero when the engine dies, not restart
    max_engine_restarts: int = 3        # restart attempts in a row before the server exits
    # tool_choice auto: the model's format (hermes ...); "auto": from the chat template
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None     # split into reasoning_content (qwen3 ...; "auto")
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, adapter folder) served at start
    lora_allowed_paths: tuple[str, ...] = ()    # load_lora_adapter: these folders and below
    strict_request_fields: bool = False     # unknown request fields: 400, not ignored
    allowed_origins: tuple[str, ...] = ()   # CORS: browser pages of these origins ("*": any)
    max_pooling_inputs: int | None = 2048   # texts or documents of one embed/score request
    enable_sleep_mode: bool = False         # /sleep, /wake_up, /pause_generation, ...
    weight_update_dirs: tuple[str, ...] = ()    # /update_weights_from_disk: folders below

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(max_connections=self.max_connections,
                          header_read_timeout_s=self.header_read_timeout_s,
                          keep_alive_timeout_s=self.keep_alive_timeout_s,
                          max_header_bytes=self.max_header_bytes,
                          body_read_timeout_s=self.body_read_timeout_s,
                          max_body_bytes=self.max_body_bytes)


@dataclass
class ServingContext:
    llm: Any
    config: ServerConfig
    metrics: ServerMetrics
    engine: EngineClient
    logprobs: LogprobFormatter
    supervisor: EngineSupervisor
    loras: LoraRegistry
    # Tokenizing off the event loop, one at a time (HF tokenizers are not reentrant).
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tllm-tokenize"))

    @classmethod
    def create(cls, llm, config: ServerConfig) -> ServingContext:
        metrics = ServerMetrics(config.model_name, llm.get_stats)
        supervisor = EngineSupervisor(llm, RestartPolicy(
            exit_on_failure=config.exit_on_engine_failure,
            max_restarts=config.max_engine_restarts))
        engine = EngineClient(llm, metrics, config.max_queue_size, config.stuck_timeout_s,
                              supervisor=supervisor,
                              max_sequences_per_request=config.max_sequences_per_request)
        loras = lora_registry(llm, config)
        supervisor.start()
        return cls(llm, config, metrics, engine, LogprobFormatter(llm.tokenizer), supervisor,
                   loras)

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The model's generation_config.json defaults (none for an engine double)."""
        return getattr(self.llm, "sampling_defaults", None) or {}

    @property
    def tokenizer(self):
        if self.llm.tokenizer is None:
            raise APIError(400, f"model {self.config.model_name!r} has no tokenizer: send "
                           "prompts as token ids", param="prompt")
        return self.llm.tokenizer

    async def run_in_tokenizer(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's "model" names (None: the base model); 404 for a
        name this server does not serve."""
        if name is None or name == self.config.model_name:
            return None
        adapter = self.loras.get(name)
        if adapter is None:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.config.model_name!r}", param="model", code="model_not_found")
        return adapter

    def close(self) -> None:
        self.supervisor.close()
        self.tokenizer_pool.shutdown(wait=False)


def lora_registry(llm, config: ServerConfig) -> LoraRegistry:
    """The adapters served: --lora-modules now, more through /v1/load_lora_adapter (only
    when the engine was built with enable_lora) from those folders and --lora-allowed-paths."""
    allowed = (*config.lora_allowed_paths, *(path for _, path in config.lora_modules))
    registry = LoraRegistry(config.model_name, getattr(llm, "lora_targets", None), allowed)
    for name, path in config.lora_modules:
        registry.add(name, path)  # a bad folder stops the server's start (ValueError)
    return registry


def check_text(text: str, param: str) -> None:
    """400 for text that is not Unicode: JSON lets a lone surrogate ("\\ud800") through, and
    the tokenizer would fail on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param}: not valid Unicode text (a lone surrogate at character "
                          f"{exc.start})", param=param) from None


# The OpenAPI description of a streamed 200 (what `event_stream` sends): the whole body as a
# string, or each event as an object (schema checkers such as schemathesis parse the events)
SSE_CONTENT = {"text/event-stream": {"schema": {
    "description": "Server-Sent Events: `data: <chunk JSON>` ..., `data: [DONE]`",
    "anyOf": [{"type": "string"},
              {"type": "object", "required": ["data"],
               "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}]}}}


def sse(body: BaseModel) -> str:
    """One Server-Sent Event."""
    return f"data: {body.model_dump_json()}\n\n"


class ChoiceUsage:
    """Tokens per choice of a stream so far, for vLLM's `continuous_usage_stats`: with it,
    every chunk carries its choice's usage (its prompt's tokens, the tokens that choice has
    generated so far, their total), as vLLM's chunks do."""

    def __init__(self, num_prompt_tokens: list[int], is_continuous: bool) -> None:
        self.num_prompt_tokens = num_prompt_tokens     # per choice
        self.num_completion_tokens = [0] * len(num_prompt_tokens)
        self.is_continuous = is_continuous

    @property
    def num_generated(self) -> int:
        return sum(self.num_completion_tokens)

    def add(self, index: int, num_tokens: int) -> None:
        self.num_completion_tokens[index] += num_tokens

    def of(self, index: int) -> Usage | None:
        """The usage a chunk of this choice carries (None unless continuous)."""
        if not self.is_continuous:
            return None
        return Usage(prompt_tokens=self.num_prompt_tokens[index],
                     completion_tokens=self.num_completion_tokens[index])


def event_stream(request: Request, generation: Generation,
                 events: AsyncIterator[str]) -> StreamingResponse:
    """An SSE response: the events, an error event if the generation fails midway, then
    [DONE]. The generation is aborted if the client goes away, and closed in any case."""
    async def body() -> AsyncIterator[str]:
        async with abort_on_disconnect(request, generation):
            try:
                async for event in events:
                    yield event
            except APIError as exc:
                yield sse(exc.body())
            except Exception as exc:  # the status line is sent: report it in the stream
                yield sse(internal_error(exc).body())  # (logged there, with its id)
            yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(generation.close))
