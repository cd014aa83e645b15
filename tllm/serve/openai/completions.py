"""POST /v1/completions: prompts as text or token ids (one or a batch), echo with prompt
logprobs (so evaluation harnesses can score log-likelihoods), streaming."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tllm.serve.context import ChoiceUsage, ServingContext, check_text, event_stream, sse
from tllm.serve.http.errors import bad_request
from tllm.serve.openai.generation import Choice, Generation, PromptInput, abort_on_disconnect
from tllm.serve.openai.params import max_new_tokens, sampling_params
from tllm.serve.openai.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                 CompletionResponse, Usage)


async def create_completion(ctx: ServingContext, request: Request,
                            body: CompletionRequest) -> Response:
    arrival = time.monotonic()
    lora = ctx.check_model(body.model)
    _check_options(body)
    # before tokenizing: a batch of prompts x n may be refused outright
    ctx.engine.check_fan_out(len(body.prompts()), body.n, max(body.n, body.best_of or 0))
    prompts = await _prompt_inputs(ctx, body)
    params = [_sampling_params(ctx, body, prompt) for prompt in prompts]
    generation = await ctx.engine.start(prompts, params, arrival,
                                        disaggregated_params=body.disaggregated_params,
                                        lora_request=lora, priority=body.priority)
    if body.stream:
        return event_stream(request, generation, _events(ctx, body, prompts, generation))
    async with generation, abort_on_disconnect(request, generation):
        choices = await generation.wait()
    return JSONResponse(_response(ctx, body, prompts, generation, choices).model_dump())


def _check_options(body: CompletionRequest) -> None:
    if body.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix",
                          code="unsupported_parameter")
    if body.max_tokens == 0 and (not body.echo or body.stream):
        raise bad_request("max_tokens must be >= 1 (0 is allowed only with echo and without "
                          "stream, to score the prompt)", param="max_tokens")
    if body.stream and body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported when streaming",
                          param="echo", code="unsupported_parameter")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported when streaming",
                          param="prompt_logprobs", code="unsupported_parameter")


async def _prompt_inputs(ctx: ServingContext, body: CompletionRequest) -> list[PromptInput]:
    inputs = []
    for prompt in body.prompts():
        if not prompt:
            raise bad_request("prompt: a prompt is empty", param="prompt")
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            token_ids = await ctx.run_in_tokenizer(ctx.tokenizer.encode, prompt)
            inputs.append(PromptInput(token_ids, prompt))
        else:
            inputs.append(PromptInput(list(prompt)))
    return inputs


def _sampling_params(ctx: ServingContext, body: CompletionRequest, prompt: PromptInput):
    # max_tokens 0 (scoring the prompt): generate one token and drop it.
    requested = 1 if body.max_tokens == 0 else body.max_tokens
    max_tokens = max_new_tokens(len(prompt.token_ids), requested, ctx.llm.max_seq_len, "prompt")
    asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs)
             if k is not None]
    prompt_logprobs = max(asked) if asked else None
    return sampling_params(body, max_tokens, logprobs=body.logprobs,
                           prompt_logprobs=prompt_logprobs, defaults=ctx.sampling_defaults)


def _prompt_text(ctx: ServingContext, prompt: PromptInput) -> str:
    if prompt.text is None:
        prompt.text = ctx.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    return prompt.text


def _response(ctx: ServingContext, body: CompletionRequest, prompts: list[PromptInput],
              generation: Generation, choices: list[Choice]) -> CompletionResponse:
    answers = [_choice(ctx, body, prompts[c.prompt_index],
                       generation.prompt_logprobs[c.prompt_index], c) for c in choices]
    num_generated = sum(len(c.token_ids) for c in choices)
    usage = Usage(prompt_tokens=sum(len(p.token_ids) for p in prompts),
                  completion_tokens=0 if body.max_tokens == 0 else num_generated)
    model = body.model or ctx.config.model_name  # an adapter's name, as asked (checked)
    return CompletionResponse(id=_request_id(), model=model, choices=answers, usage=usage)


def _choice(ctx: ServingContext, body: CompletionRequest, prompt: PromptInput,
            prompt_logprobs: list | None, choice: Choice) -> CompletionChoice:
    text, token_ids, positions = choice.text, choice.token_ids, choice.logprobs or []
    formatter = ctx.logprobs.for_request(body)
    prompt_entries = None
    if body.prompt_logprobs is not None and prompt_logprobs is not None:
        prompt_entries = formatter.prompt(prompt.token_ids, prompt_logprobs,
                                          body.prompt_logprobs)
    finish_reason, stop_reason = choice.finish_reason, choice.stop_reason
    if body.max_tokens == 0:
        text, token_ids, positions, finish_reason, stop_reason = "", [], [], "length", None
    if body.echo:
        text = _prompt_text(ctx, prompt) + text
        prompt_positions = prompt_logprobs or [None] * len(prompt.token_ids)
        token_ids, positions = prompt.token_ids + token_ids, prompt_positions + positions
    logprobs = None
    if body.logprobs is not None:
        logprobs = formatter.completion(token_ids, positions, body.logprobs, 0)
    return CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                            finish_reason=finish_reason, stop_reason=stop_reason,
                            prompt_logprobs=prompt_entries)


async def _events(ctx: ServingContext, body: CompletionRequest, prompts: list[PromptInput],
                  generation: Generation) -> AsyncIterator[str]:
    request_id, created = _request_id(), int(time.time())
    model = body.model or ctx.config.model_name  # an adapter's name, as asked (checked)
    num_choices = len(prompts) * body.n
    usage = ChoiceUsage([len(prompts[i // body.n].token_ids) for i in range(num_choices)],
                        body.continuous_usage_stats)

    def event(choice: CompletionChoice) -> str:
        return sse(CompletionResponse(id=request_id, created=created, model=model,
                                      choices=[choice], usage=usage.of(choice.index)))

    text_offsets = [0] * num_choices
    if body.echo:
        for index in range(num_choices):
            text = _prompt_text(ctx, prompts[index // body.n])
            text_offsets[index] = len(text)
            yield event(CompletionChoice(index=index, text=text))
    formatter = ctx.logprobs.for_request(body)
    async for delta in generation.deltas():
        logprobs = None
        if body.logprobs is not None and delta.token_ids:
            logprobs = formatter.completion(delta.token_ids, delta.logprobs, body.logprobs,
                                            text_offsets[delta.index])
            text_offsets[delta.index] += _text_len(logprobs)
        usage.add(delta.index, len(delta.token_ids))
        yield event(CompletionChoice(index=delta.index, text=delta.text, logprobs=logprobs,
                                     finish_reason=delta.finish_reason,
                                     stop_reason=delta.stop_reason))
    if body.include_usage:
        total = Usage(prompt_tokens=sum(len(p.token_ids) for p in prompts),
                      completion_tokens=usage.num_generated)
        yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                     usage=total))


def _text_len(logprobs: CompletionLogprobs) -> int:
    return sum(len(token) for token in logprobs.tokens)


def _request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"
