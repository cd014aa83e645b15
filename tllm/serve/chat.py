"""POST /v1/chat/completions: messages through the model's chat template (or the server's
--chat-template), logprobs in the chat format, streaming."""
from __future__ import annotations

import functools
import time
import uuid
from typing import AsyncIterator

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tllm.serve.context import ChoiceUsage, ServingContext, check_text, event_stream, sse
from tllm.serve.errors import bad_request
from tllm.serve.generation import Choice, Generation, PromptInput, abort_on_disconnect
from tllm.serve.params import max_new_tokens, sampling_params
from tllm.serve.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                 ChatCompletionRequest, ChatCompletionResponse,
                                 ChatStreamChoice, ChoiceLogprobs, DeltaMessage, Usage)


async def create_chat_completion(ctx: ServingContext, request: Request,
                                 body: ChatCompletionRequest) -> Response:
    arrival = time.monotonic()
    ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    prompt = await _chat_prompt(ctx, body)
    max_tokens = max_new_tokens(len(prompt.token_ids), body.max_new_tokens,
                                ctx.llm.max_seq_len, "messages")
    params = sampling_params(body, max_tokens,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    generation = await ctx.engine.start([prompt], [params], arrival, prompt_param="messages")
    if body.stream:
        return event_stream(request, generation, _events(ctx, body, prompt, generation))
    async with generation, abort_on_disconnect(request, generation):
        choices = await generation.wait()
    return JSONResponse(_response(ctx, body, prompt, choices).model_dump())


async def _chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> PromptInput:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in body.messages]
    for message in messages:
        check_text(message["content"], "messages")
    kwargs = {"add_generation_prompt": body.add_generation_prompt}
    if ctx.config.chat_template is not None:
        kwargs["chat_template"] = ctx.config.chat_template
    encode = functools.partial(ctx.tokenizer.encode_chat, messages, **kwargs)
    try:
        token_ids = await ctx.run_in_tokenizer(encode)
    except (ValueError, TemplateError) as exc:
        raise bad_request(f"messages: the chat template failed: {exc}",
                          param="messages") from exc
    if not token_ids:
        raise bad_request("messages: the chat template produced an empty prompt",
                          param="messages")
    return PromptInput(token_ids)


def _logprobs(ctx: ServingContext, body: ChatCompletionRequest, token_ids: list[int],
              positions) -> ChoiceLogprobs | None:
    if not body.logprobs or positions is None:
        return None
    return ChoiceLogprobs(content=ctx.logprobs.chat(token_ids, positions,
                                                    body.top_logprobs or 0))


def _response(ctx: ServingContext, body: ChatCompletionRequest, prompt: PromptInput,
              choices: list[Choice]) -> ChatCompletionResponse:
    answers = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=_logprobs(ctx, body, c.token_ids, c.logprobs),
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
               for c in choices]
    usage = Usage(prompt_tokens=len(prompt.token_ids),
                  completion_tokens=sum(len(c.token_ids) for c in choices))
    return ChatCompletionResponse(id=_request_id(), model=ctx.config.model_name,
                                  choices=answers, usage=usage)


async def _events(ctx: ServingContext, body: ChatCompletionRequest, prompt: PromptInput,
                  generation: Generation) -> AsyncIterator[str]:
    request_id, created, model = _request_id(), int(time.time()), ctx.config.model_name
    usage = ChoiceUsage([len(prompt.token_ids)] * body.n, body.continuous_usage_stats)

    def event(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model,
                                       choices=[choice], usage=usage.of(choice.index)))

    for index in range(body.n):
        yield event(ChatStreamChoice(index=index,
                                     delta=DeltaMessage(role="assistant", content="")))
    async for delta in generation.deltas():
        usage.add(delta.index, len(delta.token_ids))
        logprobs = (_logprobs(ctx, body, delta.token_ids, delta.logprobs)
                    if delta.token_ids else None)
        yield event(ChatStreamChoice(index=delta.index, delta=DeltaMessage(content=delta.text),
                                     logprobs=logprobs, finish_reason=delta.finish_reason,
                                     stop_reason=delta.stop_reason))
    if body.include_usage:
        total = Usage(prompt_tokens=len(prompt.token_ids), completion_tokens=usage.num_generated)
        yield sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                      usage=total))


def _request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"
