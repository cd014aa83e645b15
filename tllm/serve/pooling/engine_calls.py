"""What the pooling routes share: which task the model serves (and the 400 of a route for
another task), the checks of a request's inputs (how many, within the vocabulary, within
max_seq_len), and their runs in the engine, all at once so that they batch."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable, Sequence

from fastapi import Depends
from starlette.requests import Request

from tllm.llmapi.process_llm import EngineDeadError
from tllm.outputs import PoolingRequestOutput
from tllm.serve.context import ServingContext, check_text
from tllm.serve.http.errors import APIError, bad_request, from_value_error
from tllm.serve.openai.generation import abort_on_disconnect, engine_stopped
from tllm.serve.openai.params import ModelLimits

GENERATE = "generate"


def model_task(llm) -> str:
    """The task the served model runs (an engine without pooling generates)."""
    return getattr(llm, "task", GENERATE)


def check_task(ctx: ServingContext, route: str, tasks: Sequence[str]) -> None:
    task = model_task(ctx.llm)
    if task not in tasks:
        raise APIError(400, f"{route} needs a model of the {' or '.join(tasks)} task; model "
                       f"{ctx.config.model_name!r} is served for the {task!r} task (`tllm "
                       f"serve --task`)", param="model", code="unsupported_task")


def needs_task(ctx: ServingContext, *tasks: str):
    """A route dependency: 400 naming the task, before the body is read, when the model
    is served for another task (a generation route on an embedding model, and back)."""
    async def check(request: Request) -> None:
        check_task(ctx, request.url.path, tasks)
    return Depends(check)


def check_base_model(ctx: ServingContext, name: str | None) -> None:
    """404 for a model this server does not serve; 400 for a LoRA adapter (they generate)."""
    if ctx.check_model(name) is not None:
        raise bad_request(f"model {name!r} is a LoRA adapter; adapters do not pool: send "
                          f"{ctx.config.model_name!r}", param="model")


def check_count(num_items: int, param: str, ctx: ServingContext) -> None:
    limit = ctx.config.max_pooling_inputs
    if limit is not None and num_items > limit:
        raise bad_request(f"{param}: {num_items} items; at most {limit} are allowed per "
                          "request (--max-pooling-inputs)", param=param)


def check_texts(texts: Sequence[str], param: str) -> None:
    for text in texts:
        check_text(text, param)


async def token_inputs(ctx: ServingContext, limits: ModelLimits,
                       inputs: Sequence[str | list[int]], param: str) -> list[list[int]]:
    """Each input as token ids (texts tokenized, with the tokenizer's special tokens, in
    one trip to the tokenizer thread); 400 naming `param` for an empty input, an id outside
    the vocabulary, or an input longer than max_seq_len."""
    check_count(len(inputs), param, ctx)
    texts = [item for item in inputs if isinstance(item, str)]
    check_texts(texts, param)
    if any(not item for item in inputs):
        raise bad_request(f"{param}: an input is empty", param=param)
    # one batch call: the Rust tokenizer spreads it over its threads
    encoded = iter(await ctx.run_in_tokenizer(lambda: ctx.tokenizer.encode_batch(texts)))
    token_ids = [next(encoded) if isinstance(item, str) else list(item) for item in inputs]
    max_len = ctx.llm.max_seq_len
    for index, ids in enumerate(token_ids):
        outside = [t for t in ids if not 0 <= t <= limits.max_token_id]
        if outside:
            raise bad_request(f"{param}: input {index} has token id {outside[0]}, outside the "
                              f"vocabulary (size {limits.max_token_id + 1})", param=param)
        if not ids:     # a text the tokenizer makes nothing of
            raise bad_request(f"{param}: input {index} has no tokens", param=param)
        if len(ids) > max_len:
            raise APIError(400, f"{param}: input {index} has {len(ids)} tokens, more than "
                           f"the model's max_seq_len ({max_len})", param=param,
                           code="context_length_exceeded")
    return token_ids


async def run_all(ctx: ServingContext, request: Request | None,
                  calls: list[Callable[[], Awaitable]], param: str,
                  num_inputs: int | None = None) -> list:
    """Run the engine calls together (they batch in the engine); one that fails, or the
    HTTP client going away, cancels the rest (without a `request`, as for a gRPC call, the
    call's cancellation does). Refused as a generation request is when the engine is down
    (503) or its queue full (429); a ValueError of the engine is a 400 naming `param`. The
    request counts in the server's metrics: its `num_inputs` (one per call unless given)
    as finished or aborted."""
    arrival = time.monotonic()
    ctx.engine.check_room()
    running = _Running([asyncio.ensure_future(call()) for call in calls])
    try:
        async with (abort_on_disconnect(request, running) if request is not None
                    else contextlib.nullcontext()):
            results = await asyncio.gather(*running.tasks)
    except asyncio.CancelledError:
        ctx.metrics.count_pooling_aborted(num_inputs or len(calls))
        if not running.is_aborted:      # this handler itself is cancelled
            raise
        raise APIError(400, "the client disconnected", code="client_disconnected") from None
    except ValueError as exc:
        raise _as_field(from_value_error(exc, param), param) from exc
    except EngineDeadError as exc:
        ctx.metrics.count_pooling_aborted(num_inputs or len(calls))
        raise engine_stopped() from exc
    finally:
        running.cancel()    # those still running after a failure (done ones: no-op)
    ctx.metrics.count_pooled([len(output.prompt_token_ids) for output in _flat(results)],
                             arrival)
    return results


def _flat(results: list) -> list[PoolingRequestOutput]:
    """The outputs of the calls (score_async's: a list each)."""
    return [output for result in results
            for output in (result if isinstance(result, list) else [result])]


class _Running:
    """A request's engine calls, for abort_on_disconnect to cancel."""

    def __init__(self, tasks: list[asyncio.Future]) -> None:
        self.tasks = tasks
        self.is_aborted = False

    def abort(self) -> None:
        self.is_aborted = True
        self.cancel()

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


def _as_field(error: APIError, param: str) -> APIError:
    """The engine's names for what it was given, as the request's field `param`."""
    if error.param in ("prompt", "prompts"):
        error.message = f"{param}{error.message.removeprefix(error.param)}"
        error.param = param
    return error


def num_tokens(outputs: Sequence[PoolingRequestOutput]) -> int:
    return sum(len(output.prompt_token_ids) for output in outputs)
