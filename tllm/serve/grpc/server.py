"""The gRPC endpoint (`tllm serve MODEL --grpc-port PORT`, grpcio's asyncio server):
tllm.v1.Generation (tllm/serve/grpc/tllm.proto; Embed for embedding models) on the same
engine, event loop and admission control as the HTTP routes. A request is validated as a completion body is (the same
messages), and HTTP statuses become gRPC codes: 400 INVALID_ARGUMENT, 404 NOT_FOUND, 429
RESOURCE_EXHAUSTED, 503 UNAVAILABLE. With --api-key, every call but Health needs metadata
`authorization: Bearer KEY` (UNAUTHENTICATED otherwise), as the HTTP routes do."""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import AsyncIterator

import grpc
from pydantic import ValidationError

from tllm.multimodal.media import MediaError, decode_image_bytes
from tllm.serve.http.auth import key_matches
from tllm.serve.context import ServingContext
from tllm.serve.http.errors import APIError, from_validation_error
from tllm.serve.openai.chat import check_takes_images
from tllm.serve.openai.generation import PromptInput
from tllm.serve.grpc import tllm_pb2 as pb
from tllm.serve.grpc.embed import embed
from tllm.serve.grpc import tllm_pb2_grpc as pb_grpc
from tllm.serve.openai.params import ModelLimits, max_new_tokens, sampling_params
from tllm.serve.openai.protocol import CompletionRequest

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
# SamplingParams fields copied into the completion body as they are (when set)
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "skip_special_tokens", "logprobs")
_PLAIN = ("ignore_eos", "presence_penalty", "frequency_penalty", "min_tokens",
          "include_stop_str_in_output")


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.limits = ModelLimits.of(ctx.llm)
        self._running: dict[str, object] = {}     # request id -> its Generation
        self._ids = itertools.count()

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator:
        request_id = request.request_id or f"grpc-{next(self._ids)}"
        if request_id in self._running:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {request_id!r} is already running")
        try:
            prompt, body = await self._prompt_and_body(request)
            requested = request.sampling.max_tokens if request.sampling.HasField(
                "max_tokens") else None
            max_tokens = max_new_tokens(len(prompt.token_ids), requested,
                                        self.ctx.llm.max_seq_len, "prompt")
            params = sampling_params(body, max_tokens, logprobs=body.logprobs,
                                     defaults=self.ctx.sampling_defaults)
            generation = await self.ctx.engine.start([prompt], [params], time.monotonic())
        except APIError as exc:
            await context.abort(_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)
        self._running[request_id] = generation
        num_generated = 0
        try:
            async with generation:
                async for delta in generation.deltas():
                    num_generated += len(delta.token_ids)
                    yield _response(request_id, delta, len(prompt.token_ids), num_generated)
        except APIError as exc:
            await context.abort(_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)
        finally:
            self._running.pop(request_id, None)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        generation = self._running.get(request.request_id)
        if generation is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no request {request.request_id!r} is running")
        generation.abort()
        return pb.AbortResponse()

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        reason = self.ctx.engine.health()
        return pb.HealthResponse(healthy=reason is None, reason=reason or "")

    async def ModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfoResponse:
        tokenizer = self.ctx.llm.tokenizer
        return pb.ModelInfoResponse(
            model=self.ctx.config.model_name, max_model_len=self.ctx.llm.max_seq_len,
            vocab_size=self.limits.vocab_size or 0, has_tokenizer=tokenizer is not None,
            eos_token_ids=sorted(getattr(tokenizer, "eos_token_ids", ()) or ()))

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        try:
            return await embed(self.ctx, self.limits, request)
        except APIError as exc:
            await context.abort(_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)

    async def _prompt_and_body(self, request: pb.GenerateRequest):
        """The prompt, and the request as a completion body (validated as HTTP's are)."""
        which = request.WhichOneof("prompt")
        if which is None:
            raise APIError(400, "prompt: give text or token_ids", param="prompt")
        prompt_value = request.text if which == "text" else list(request.token_ids.ids)
        if not prompt_value:
            raise APIError(400, "prompt: the prompt is empty", param="prompt")
        try:
            body = CompletionRequest.model_validate(_body(request, prompt_value))
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        self.limits.check(body)
        if request.images:
            return await self._image_prompt(request, which), body
        if which == "text":
            token_ids = await self.ctx.run_in_tokenizer(self.ctx.tokenizer.encode, request.text)
            return PromptInput(token_ids, request.text), body
        return PromptInput(prompt_value), body


    async def _image_prompt(self, request: pb.GenerateRequest, which: str) -> PromptInput:
        """A text prompt with images, each decoded within the server's limits (400 naming
        `images[i]` otherwise); the engine expands the text's placeholders."""
        if which != "text":
            raise APIError(400, "images: a prompt with images is given as text",
                           param="images")
        check_takes_images(self.ctx, "images")
        limits = getattr(getattr(self.ctx.llm, "args", None), "limit_mm_per_prompt", None)
        limit = limits.get("image", 0) if limits is not None else None
        if limit is not None and len(request.images) > limit:
            raise APIError(400, f"images: {len(request.images)} images given; at most {limit} "
                           "a prompt (--limit-mm-per-prompt)", param="images")

        def prepare() -> PromptInput:
            images = [decode_image_bytes(raw, f"images[{i}]", self.ctx.config.max_image_pixels)
                      for i, raw in enumerate(request.images)]
            return PromptInput(self.ctx.tokenizer.encode(request.text), request.text, images,
                               add_special_tokens=True)
        try:
            return await self.ctx.run_in_tokenizer(prepare)
        except MediaError as exc:
            raise APIError(400, str(exc), param=exc.param) from None


def _body(request: pb.GenerateRequest, prompt) -> dict:
    sampling = request.sampling
    body = {"prompt": prompt, "max_tokens": None}
    if sampling.HasField("max_tokens"):
        body["max_tokens"] = sampling.max_tokens
    for name in _OPTIONAL:
        if sampling.HasField(name):
            body[name] = getattr(sampling, name)
    for name in _PLAIN:
        body[name] = getattr(sampling, name)
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if body["max_tokens"] is None:
        body["max_tokens"] = 1     # validated as a body; the room left is taken below
    return body


def _response(request_id: str, delta, num_prompt: int, num_generated: int):
    logprobs = []
    for token_id, position in zip(delta.token_ids, delta.logprobs or ()):
        chosen = position.get(token_id)
        logprobs.append(pb.PositionLogprobs(
            token_id=token_id, logprob=chosen.logprob if chosen is not None else 0.0,
            top=[pb.TopLogprob(token_id=t, logprob=p.logprob) for t, p in
                 sorted(position.items(), key=lambda item: item[1].rank or 0)]))
    return pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids,
                               text=delta.text, logprobs=logprobs,
                               finish_reason=delta.finish_reason or "",
                               prompt_tokens=num_prompt, completion_tokens=num_generated)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without `authorization: Bearer KEY`, but Health (a probe,
    as HTTP's /health)."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.endswith("/Health"):
            return handler
        metadata = dict(details.invocation_metadata or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        if scheme.lower() == "bearer" and key_matches(token, self.api_key):
            return handler
        return _refusal(handler)


def _refusal(handler):
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED."""
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key: "
                            "send metadata 'authorization: Bearer <key>'")
    make = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler)
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


async def start_grpc_server(ctx: ServingContext, host: str, port: int) -> grpc.aio.Server:
    """The gRPC server on the running event loop (the HTTP server's), started."""
    api_key = ctx.config.api_key
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(api_key)] if api_key else None)
    pb_grpc.add_GenerationServicer_to_server(GenerationService(ctx), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise ValueError(f"--grpc-port {port}: cannot listen on {host}:{port}")
    server.bound_port = bound
    await server.start()
    return server


async def serve_with_grpc(http_server, ctx: ServingContext, host: str, port: int,
                          sockets=None) -> None:
    """uvicorn's server and the gRPC server on one event loop, until uvicorn stops."""
    grpc_server = await start_grpc_server(ctx, host, port)
    try:
        await http_server.serve(sockets=sockets)
    finally:
        await grpc_server.stop(grace=2)


def run_with_grpc(http_server, ctx: ServingContext, host: str, port: int) -> None:
    """(Blocking) what uvicorn.Server.run does, with the gRPC server beside it."""
    asyncio.run(serve_with_grpc(http_server, ctx, host, port))
