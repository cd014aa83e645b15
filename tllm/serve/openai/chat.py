"""POST /v1/chat/completions: messages (and tools, documents, chat_template_kwargs) through the
model's chat template (or the server's --chat-template), logprobs in the chat format,
streaming; response_format and vLLM's guided_* fields as guided decoding; tool calls and
reasoning split from the output."""
from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Any, AsyncIterator

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tllm.multimodal.chat import IMAGE_PART_TYPES, split_chat_images
from tllm.multimodal.media import MediaError
from tllm.serve.context import ChoiceUsage, ServingContext, check_text, event_stream, sse
from tllm.serve.http.errors import bad_request
from tllm.serve.openai.image_fetch import prefetch_images
from tllm.serve.openai.generation import Choice, Generation, PromptInput, abort_on_disconnect
from tllm.serve.openai.params import guided_decoding, guided_request, max_new_tokens, sampling_params
from tllm.serve.openai.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                 ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
                                 ChatStreamChoice, ChoiceLogprobs, DeltaFunctionCall,
                                 DeltaMessage, DeltaToolCall, Usage)
from tllm.serve.openai.choice_stream import ChoiceStream, OutputFormat, StreamUpdate
from tllm.serve.openai.reasoning import ReasoningParser, after_reasoning, reasoning_parser
from tllm.serve.openai.tool_calls import ANY_OBJECT, JSON_ERRORS, ToolRequest, forced_schema
from tllm.serve.openai.tool_parsers import tool_parser

# The prompt's last tokens, decoded for a reasoning parser that reads the prompt (whether
# the template opened the thinking)
PROMPT_TAIL_TOKENS = 32


async def create_chat_completion(ctx: ServingContext, request: Request,
                                 body: ChatCompletionRequest) -> Response:
    arrival = time.monotonic()
    lora = ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported when streaming",
                          param="prompt_logprobs", code="unsupported_parameter")
    prompt = await chat_prompt(ctx, body)
    max_tokens = max_new_tokens(len(prompt.token_ids), body.max_new_tokens,
                                ctx.llm.max_seq_len, "messages")
    reasoning = await _reasoning_parser(ctx, prompt)
    guided = after_reasoning(guided_request(body, _guided_by_chat_fields(body)), reasoning)
    if guided is not None:  # compiling a grammar takes a while: off the event loop
        guided = await ctx.run_in_tokenizer(guided_decoding, guided, ctx.tokenizer)
    body = _with_marks_decoded(body, reasoning)
    params = sampling_params(body, max_tokens,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                             prompt_logprobs=body.prompt_logprobs,
                             guided_decoding=guided, defaults=ctx.sampling_defaults)
    output = OutputFormat.of(reasoning, tool_parser(ctx.config.tool_call_parser),
                             ToolRequest.of_chat(body))
    generation = await ctx.engine.start([prompt], [params], arrival, prompt_param="messages",
                                        disaggregated_params=body.disaggregated_params,
                                        lora_request=lora, priority=body.priority)
    if body.stream:
        return event_stream(request, generation,
                            _events(ctx, body, prompt, generation, output))
    async with generation, abort_on_disconnect(request, generation):
        choices = await generation.wait()
    num_prompt = generation.num_prompt_tokens(0, len(prompt.token_ids))
    response = _response(ctx, body, num_prompt, choices, output)
    response.prompt_logprobs = _prompt_logprobs(ctx, body, prompt.token_ids,
                                                generation.prompt_logprobs[0])
    return JSONResponse(response.model_dump())


def _with_marks_decoded(body: ChatCompletionRequest,
                        reasoning: ReasoningParser | None) -> ChatCompletionRequest:
    """The body with skip_special_tokens off where the reasoning parser reads special
    tokens (gpt-oss's channels), unless the request says otherwise."""
    if (reasoning is None or not reasoning.needs_special_tokens
            or "skip_special_tokens" in body.model_fields_set):
        return body
    return body.model_copy(update={"skip_special_tokens": False})


def _guided_by_chat_fields(body: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """GuidedDecodingParams keywords asked by response_format or a forced tool_choice."""
    asked = {}
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif response_format is not None and response_format.type == "json_schema":
        asked["response_format"] = {"json": response_format.json_schema.json_schema
                                    or ANY_OBJECT}
    tools = ToolRequest.of_chat(body)
    if tools.is_forced:
        asked["tool_choice"] = {"json": forced_schema(tools)}
    return asked


async def _reasoning_parser(ctx: ServingContext,
                            prompt: PromptInput) -> ReasoningParser | None:
    """The server's reasoning parser (None: no split), told this prompt if it reads it."""
    parser = reasoning_parser(ctx.config.reasoning_parser)
    if parser is None or not parser.reads_prompt:
        return parser
    tail = await ctx.run_in_tokenizer(functools.partial(
        ctx.tokenizer.decode, prompt.token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
    return parser.for_prompt(tail)


def _message(output: OutputFormat, text: str,
             finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    reasoning, content, calls = output.split(text)
    return (AssistantMessage(content=content, reasoning_content=reasoning,
                             tool_calls=[call.tool_call() for call in calls]),
            "tool_calls" if calls and finish_reason == "stop" else finish_reason)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A history message as chat templates take it (tool call arguments as objects; a
    message with images keeps its parts)."""
    content: Any = message.text()
    if message.has_images:
        content = [part.model_dump(exclude_none=True) for part in message.content]
    out = {"role": "system" if message.role == "developer" else message.role,
           "content": content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _arguments(arguments: str | dict) -> dict | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except JSON_ERRORS:
        return arguments


async def chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> PromptInput:
    """The prompt of a request's messages and template fields (chat's, /tokenize's)."""
    messages = [_template_message(m) for m in body.messages]
    for message in body.messages:
        check_text(message.text(), "messages")
    if any(message.has_images for message in body.messages):
        return await image_chat_prompt(ctx, messages, "messages", **template_kwargs(body))
    return await encode_messages(ctx, messages, "messages", **template_kwargs(body))


def check_takes_images(ctx: ServingContext, param: str,
                       messages: list[dict] | None = None) -> None:
    """A 400 naming the first image part (`messages.0.content.1`), before any image is
    decoded, when the model takes none (a text model)."""
    if getattr(ctx.llm, "takes_images", False):
        return
    where = next((f"{param}.{i}.content.{j}" for i, message in enumerate(messages or ())
                  if isinstance(message.get("content"), list)
                  for j, part in enumerate(message["content"])
                  if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES), param)
    raise bad_request(f"{where}: model {ctx.config.model_name!r} takes no images (image "
                      "parts need a vision-language model)", param=where)


async def image_chat_prompt(ctx: ServingContext, messages: list[dict], param: str,
                            **kwargs) -> PromptInput:
    """A prompt with images: each image_url decoded within the server's limits (a 400
    naming the part otherwise), the template rendered with the model's placeholders;
    the engine expands them."""
    check_takes_images(ctx, param, messages)
    if ctx.config.chat_template is not None:
        kwargs["chat_template"] = ctx.config.chat_template
    args = getattr(ctx.llm, "args", None)
    limit = getattr(args, "limit_mm_per_prompt", None)
    max_images = limit.get("image", 0) if limit is not None else None
    tokenizer = ctx.tokenizer

    def prepare(fetch) -> PromptInput:
        parts, images = split_chat_images(
            messages, param, ctx.config.max_image_pixels,
            getattr(args, "allowed_local_media_path", None), max_images, fetch)
        text = tokenizer.apply_chat_template(parts, **kwargs)
        return PromptInput(tokenizer.encode(text, add_special_tokens=False), text, images)
    try:
        fetch = await prefetch_images(args, messages, param, max_images)
        return await ctx.run_in_tokenizer(prepare, fetch)
    except MediaError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    except (ValueError, TypeError, TemplateError) as exc:
        raise bad_request(f"{param}: the chat template failed: {exc}", param=param) from exc


# apply_chat_template's own settings, and the variables it sets itself: not for a request's
# chat_template_kwargs (a client's template would run in the server's place, and a clash
# of names is a TypeError, not a template error).
_NOT_TEMPLATE_VARIABLES = frozenset({
    "chat_template", "conversation", "messages", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's keyword arguments the request asks for (chat_template_kwargs
    over the fields of their own, as in vLLM); 400 for a name the template may not take."""
    kwargs: dict[str, Any] = {"add_generation_prompt": body.add_generation_prompt,
                              "continue_final_message": body.continue_final_message}
    if body.tools and body.tool_choice != "none":
        kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if body.documents is not None:
        kwargs["documents"] = body.documents
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    reserved = sorted(_NOT_TEMPLATE_VARIABLES.intersection(body.chat_template_kwargs or {}))
    if reserved:
        raise bad_request(f"chat_template_kwargs: {reserved[0]!r} is not a template "
                          "variable a request may set", param="chat_template_kwargs")
    kwargs.update(body.chat_template_kwargs or {})
    if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
        raise bad_request("continue_final_message needs add_generation_prompt set to false",
                          param="continue_final_message")
    return kwargs


async def encode_messages(ctx: ServingContext, messages: list[dict], param: str,
                          **kwargs) -> PromptInput:
    """The prompt of chat-template messages (the server's template if it has one); a
    template error or an empty prompt is a 400 naming `param`."""
    if ctx.config.chat_template is not None:
        kwargs["chat_template"] = ctx.config.chat_template
    encode = functools.partial(ctx.tokenizer.encode_chat, messages, **kwargs)
    try:
        token_ids = await ctx.run_in_tokenizer(encode)
    except (ValueError, TypeError, TemplateError) as exc:  # TypeError: `1 + "a"` in Jinja
        raise bad_request(f"{param}: the chat template failed: {exc}", param=param) from exc
    if not token_ids:
        raise bad_request(f"{param}: the chat template produced an empty prompt",
                          param=param)
    return PromptInput(token_ids)


def _logprobs(ctx: ServingContext, body: ChatCompletionRequest, token_ids: list[int],
              positions) -> ChoiceLogprobs | None:
    if not body.logprobs or positions is None:
        return None
    formatter = ctx.logprobs.for_request(body)
    return ChoiceLogprobs(content=formatter.chat(token_ids, positions, body.top_logprobs or 0))


def _prompt_logprobs(ctx: ServingContext, body: ChatCompletionRequest, token_ids: list[int],
                     positions) -> list | None:
    if body.prompt_logprobs is None or positions is None:
        return None
    return ctx.logprobs.for_request(body).prompt(token_ids, positions, body.prompt_logprobs)


def _response(ctx: ServingContext, body: ChatCompletionRequest, num_prompt_tokens: int,
              choices: list[Choice], output: OutputFormat) -> ChatCompletionResponse:
    answers = []
    for c in choices:
        message, finish_reason = _message(output, c.text, c.finish_reason)
        answers.append(ChatChoice(index=c.index, message=message,
                                  logprobs=_logprobs(ctx, body, c.token_ids, c.logprobs),
                                  finish_reason=finish_reason, stop_reason=c.stop_reason))
    usage = Usage(prompt_tokens=num_prompt_tokens,
                  completion_tokens=sum(len(c.token_ids) for c in choices))
    model = body.model or ctx.config.model_name  # an adapter's name, as asked (checked)
    return ChatCompletionResponse(id=_request_id(), model=model, choices=answers, usage=usage)


async def _events(ctx: ServingContext, body: ChatCompletionRequest, prompt: PromptInput,
                  generation: Generation, output: OutputFormat) -> AsyncIterator[str]:
    request_id, created = _request_id(), int(time.time())
    model = body.model or ctx.config.model_name  # an adapter's name, as asked (checked)
    usage = ChoiceUsage([len(prompt.token_ids)] * body.n, body.continuous_usage_stats)

    def event(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model,
                                       choices=[choice], usage=usage.of(choice.index)))

    for index in range(body.n):
        yield event(ChatStreamChoice(index=index,
                                     delta=DeltaMessage(role="assistant", content="")))
    streams = [ChoiceStream(output) for _ in range(body.n)]
    async for delta in generation.deltas():
        usage.add(delta.index, len(delta.token_ids))
        logprobs = (_logprobs(ctx, body, delta.token_ids, delta.logprobs)
                    if delta.token_ids else None)
        update = streams[delta.index].add(delta.text, delta.finish_reason)
        yield event(ChatStreamChoice(index=delta.index, delta=_delta_message(update),
                                     logprobs=logprobs, finish_reason=update.finish_reason,
                                     stop_reason=delta.stop_reason))
    if body.include_usage:
        total = Usage(prompt_tokens=generation.num_prompt_tokens(0, len(prompt.token_ids)),
                      completion_tokens=usage.num_generated)
        yield sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                      usage=total))


def _delta_message(update: StreamUpdate) -> DeltaMessage:
    """A chunk's delta in OpenAI's shape: a call's first piece has its id and name, later
    ones pieces of its arguments. The type goes with every piece: a client that merges the
    pieces (openai's stream helper) would take a null type as the call's type."""
    tool_calls = [DeltaToolCall(index=call.index, id=call.id, type="function",
                                function=DeltaFunctionCall(name=call.name,
                                                           arguments=call.arguments))
                  for call in update.calls] or None
    plain = not (update.reasoning or tool_calls)
    return DeltaMessage(content=update.content if update.content or plain else None,
                        reasoning_content=update.reasoning or None, tool_calls=tool_calls)


def _request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"
