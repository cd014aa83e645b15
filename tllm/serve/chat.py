"""POST /v1/chat/completions: messages (and tools) through the model's chat template (or the
server's --chat-template), logprobs in the chat format, streaming; response_format and vLLM's
guided_* fields as guided decoding; tool calls and reasoning split from the output."""
from __future__ import annotations

import functools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tllm.serve.context import ChoiceUsage, ServingContext, check_text, event_stream, sse
from tllm.serve.errors import bad_request
from tllm.serve.generation import Choice, Generation, PromptInput, abort_on_disconnect
from tllm.serve.params import guided_decoding, guided_request, max_new_tokens, sampling_params
from tllm.serve.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                 ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
                                 ChatStreamChoice, ChoiceLogprobs, DeltaFunctionCall,
                                 DeltaMessage, DeltaToolCall, Usage)
from tllm.serve.reasoning import ReasoningParser, ReasoningStream, reasoning_parser
from tllm.serve.tool_parsers import (ANY_OBJECT, ParsedCall, ToolParser, forced_schema,
                                     is_forced, new_call_id, parse_forced, tool_parser)


async def create_chat_completion(ctx: ServingContext, request: Request,
                                 body: ChatCompletionRequest) -> Response:
    arrival = time.monotonic()
    lora = ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    prompt = await _chat_prompt(ctx, body)
    max_tokens = max_new_tokens(len(prompt.token_ids), body.max_new_tokens,
                                ctx.llm.max_seq_len, "messages")
    guided = guided_request(body, _guided_by_chat_fields(body))
    if guided is not None:  # compiling a grammar takes a while: off the event loop
        guided = await ctx.run_in_tokenizer(guided_decoding, guided, ctx.tokenizer)
    params = sampling_params(body, max_tokens,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                             guided_decoding=guided)
    output = _output_format(ctx, body)
    generation = await ctx.engine.start([prompt], [params], arrival, prompt_param="messages",
                                        disaggregated_params=body.disaggregated_params,
                                        lora_request=lora)
    if body.stream:
        return event_stream(request, generation,
                            _events(ctx, body, prompt, generation, output))
    async with generation, abort_on_disconnect(request, generation):
        choices = await generation.wait()
    return JSONResponse(_response(ctx, body, prompt, choices, output).model_dump())


def _guided_by_chat_fields(body: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """GuidedDecodingParams keywords asked by response_format or a forced tool_choice."""
    asked = {}
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif response_format is not None and response_format.type == "json_schema":
        asked["response_format"] = {"json": response_format.json_schema.json_schema
                                    or ANY_OBJECT}
    if is_forced(body):
        asked["tool_choice"] = {"json": forced_schema(body)}
    return asked


@dataclass(frozen=True)
class _OutputFormat:
    """How a choice's text becomes a message: reasoning split off, tool calls parsed."""

    reasoning: ReasoningParser | None
    tools: ToolParser | None        # tool_choice auto with --tool-call-parser
    forced: ChatCompletionRequest | None    # required or a named function

    def calls(self, content: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of the answer after any reasoning."""
        if self.forced is not None:
            calls = parse_forced(content, self.forced)
            return (None, calls) if calls else (content, [])
        if self.tools is not None:
            return self.tools.parse(content)
        return content, []


def _output_format(ctx: ServingContext, body: ChatCompletionRequest) -> _OutputFormat:
    auto = bool(body.tools) and body.tool_choice in (None, "auto")
    return _OutputFormat(reasoning_parser(ctx.config.reasoning_parser),
                         tool_parser(ctx.config.tool_call_parser) if auto else None,
                         body if is_forced(body) else None)


def _finish_reason(finish_reason: str | None, calls: list[ParsedCall]) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _message(output: _OutputFormat, text: str,
             finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    reasoning, content = output.reasoning.split(text) if output.reasoning else (None, text)
    content, calls = output.calls(content)
    return (AssistantMessage(content=content, reasoning_content=reasoning or None,
                             tool_calls=[call.tool_call() for call in calls]),
            _finish_reason(finish_reason, calls))


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A history message as chat templates take it (tool call arguments as objects)."""
    out = {"role": "system" if message.role == "developer" else message.role,
           "content": message.text()}
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
    except json.JSONDecodeError:
        return arguments


async def _chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> PromptInput:
    messages = [_template_message(m) for m in body.messages]
    for message in messages:
        check_text(message["content"], "messages")
    kwargs = {"add_generation_prompt": body.add_generation_prompt}
    if body.tools and body.tool_choice != "none":
        kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    return await encode_messages(ctx, messages, "messages", **kwargs)


async def encode_messages(ctx: ServingContext, messages: list[dict], param: str,
                          **kwargs) -> PromptInput:
    """The prompt of chat-template messages (the server's template if it has one); a
    template error or an empty prompt is a 400 naming `param`."""
    if ctx.config.chat_template is not None:
        kwargs["chat_template"] = ctx.config.chat_template
    encode = functools.partial(ctx.tokenizer.encode_chat, messages, **kwargs)
    try:
        token_ids = await ctx.run_in_tokenizer(encode)
    except (ValueError, TemplateError) as exc:
        raise bad_request(f"{param}: the chat template failed: {exc}", param=param) from exc
    if not token_ids:
        raise bad_request(f"{param}: the chat template produced an empty prompt",
                          param=param)
    return PromptInput(token_ids)


def _logprobs(ctx: ServingContext, body: ChatCompletionRequest, token_ids: list[int],
              positions) -> ChoiceLogprobs | None:
    if not body.logprobs or positions is None:
        return None
    return ChoiceLogprobs(content=ctx.logprobs.chat(token_ids, positions,
                                                    body.top_logprobs or 0))


def _response(ctx: ServingContext, body: ChatCompletionRequest, prompt: PromptInput,
              choices: list[Choice], output: _OutputFormat) -> ChatCompletionResponse:
    answers = []
    for c in choices:
        message, finish_reason = _message(output, c.text, c.finish_reason)
        answers.append(ChatChoice(index=c.index, message=message,
                                  logprobs=_logprobs(ctx, body, c.token_ids, c.logprobs),
                                  finish_reason=finish_reason, stop_reason=c.stop_reason))
    usage = Usage(prompt_tokens=len(prompt.token_ids),
                  completion_tokens=sum(len(c.token_ids) for c in choices))
    return ChatCompletionResponse(id=_request_id(), model=ctx.config.model_name,
                                  choices=answers, usage=usage)


async def _events(ctx: ServingContext, body: ChatCompletionRequest, prompt: PromptInput,
                  generation: Generation, output: _OutputFormat) -> AsyncIterator[str]:
    request_id, created, model = _request_id(), int(time.time()), ctx.config.model_name
    usage = ChoiceUsage([len(prompt.token_ids)] * body.n, body.continuous_usage_stats)

    def event(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model,
                                       choices=[choice], usage=usage.of(choice.index)))

    for index in range(body.n):
        yield event(ChatStreamChoice(index=index,
                                     delta=DeltaMessage(role="assistant", content="")))
    streams = [_ChoiceStream(output) for _ in range(body.n)]
    async for delta in generation.deltas():
        usage.add(delta.index, len(delta.token_ids))
        logprobs = (_logprobs(ctx, body, delta.token_ids, delta.logprobs)
                    if delta.token_ids else None)
        message, finish_reason = streams[delta.index].add(delta.text, delta.finish_reason)
        yield event(ChatStreamChoice(index=delta.index, delta=message, logprobs=logprobs,
                                     finish_reason=finish_reason,
                                     stop_reason=delta.stop_reason))
    if body.include_usage:
        total = Usage(prompt_tokens=len(prompt.token_ids), completion_tokens=usage.num_generated)
        yield sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                      usage=total))


class _ChoiceStream:
    """One streamed choice: reasoning deltas split off; content that may be tool calls held
    back (all of it for a forced call) and sent as tool-call deltas when the choice ends."""

    def __init__(self, output: _OutputFormat) -> None:
        self.output = output
        self.reasoning = ReasoningStream(output.reasoning) if output.reasoning else None
        self.content = ""
        self.sent = 0       # characters of content sent

    def add(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        is_final = finish_reason is not None
        reasoning, content = (self.reasoning.add(text, is_final) if self.reasoning
                              else ("", text))
        self.content += content
        calls = []
        if is_final and (self.output.forced or self.output.tools):
            _, calls = self.output.calls(self.content)
            end = len(self.content) if not calls else self.sent
        else:
            end = self._safe_end()
        new_content, self.sent = self.content[self.sent:end], max(self.sent, end)
        tool_calls = [DeltaToolCall(index=i, id=new_call_id(), type="function",
                                    function=DeltaFunctionCall(name=call.name,
                                                               arguments=call.arguments))
                      for i, call in enumerate(calls)] or None
        plain = not (reasoning or tool_calls)
        delta = DeltaMessage(content=new_content if new_content or plain else None,
                             reasoning_content=reasoning or None, tool_calls=tool_calls)
        return delta, _finish_reason(finish_reason, calls)

    def _safe_end(self) -> int:
        """How much of the content may be sent before the choice ends."""
        if self.output.forced is not None:
            return 0
        if self.output.tools is not None:
            start = self.output.tools.calls_start(self.content)
            return len(self.content) if start is None else start
        return len(self.content)


def _request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"
