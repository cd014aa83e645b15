"""POST /tokenize and /detokenize (vLLM's), for every model: a prompt (or chat messages
through the chat template, as /v1/chat/completions renders them) to token ids, and back."""
from __future__ import annotations

import functools

from tllm.serve.context import ServingContext, check_text
from tllm.serve.http.errors import bad_request
from tllm.serve.openai.chat import chat_prompt
from tllm.serve.openai.params import ModelLimits
from tllm.serve.pooling.protocol import (DetokenizeRequest, DetokenizeResponse,
                                         TokenizeRequest, TokenizeResponse)


async def tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(body.model)     # an adapter shares the model's tokenizer
    if body.messages is not None:
        token_ids = (await chat_prompt(ctx, body)).token_ids
    else:
        check_text(body.prompt, "prompt")
        add_special_tokens = body.add_special_tokens is not False
        token_ids = await ctx.run_in_tokenizer(functools.partial(
            ctx.tokenizer.encode, body.prompt, add_special_tokens=add_special_tokens))
    return TokenizeResponse(count=len(token_ids), max_model_len=ctx.llm.max_seq_len,
                            tokens=token_ids)


async def detokenize(ctx: ServingContext, limits: ModelLimits,
                     body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(body.model)
    worst = max(body.tokens, default=0)
    vocab_size = getattr(ctx.tokenizer, "vocab_size", None)
    if worst > limits.max_token_id or (vocab_size is not None and worst >= vocab_size):
        raise bad_request(f"tokens: token id {worst} is outside the vocabulary",
                          param="tokens")
    text = await ctx.run_in_tokenizer(functools.partial(
        ctx.tokenizer.decode, body.tokens, skip_special_tokens=False))
    return DetokenizeResponse(prompt=text)
