"""The OpenAI-compatible HTTP server: FastAPI routes over one LLM (one executor loop shared
by all requests), API-key check, body size cap, Prometheus metrics, health."""
from __future__ import annotations

import hmac
import logging

from fastapi import APIRouter, Depends, FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tllm import __version__
from tllm.serve.chat import create_chat_completion
from tllm.serve.completions import create_completion
from tllm.serve.context import ServerConfig, ServingContext
from tllm.serve.errors import (APIError, bad_request, from_validation_error,
                               install_error_handlers, internal_error)
from tllm.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tllm.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

logger = logging.getLogger(__name__)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/version",
             "/metrics")


def build_app(llm, config: ServerConfig) -> FastAPI:
    """The server's ASGI app over a loaded LLM; the caller owns the LLM and shuts it down,
    and calls `app.state.ctx.close()` once the server has stopped."""
    ctx = ServingContext.create(llm, config)
    app = FastAPI(title="tllm", version=__version__)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(_HttpGuard, metrics=ctx.metrics)
    app.include_router(_api_routes(ctx))
    app.include_router(_ops_routes(ctx))
    return app


def _api_routes(ctx: ServingContext) -> APIRouter:
    config = ctx.config
    api = APIRouter(prefix="/v1", dependencies=[Depends(api_key_check(config.api_key))])

    @api.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, config.max_body_bytes)
        return await create_completion(ctx, request, body)

    @api.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, config.max_body_bytes)
        return await create_chat_completion(ctx, request, body)

    @api.get("/models")
    async def models() -> Response:
        card = ModelCard(id=config.model_name, root=config.model,
                         max_model_len=ctx.llm.max_seq_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    return api


def _ops_routes(ctx: ServingContext) -> APIRouter:
    ops = APIRouter()

    @ops.get("/health")
    async def health() -> Response:
        reason = ctx.engine.health()
        if reason is not None:
            return APIError(503, reason, code="engine_unhealthy").response()
        return JSONResponse({"status": "ok"})

    @ops.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @ops.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return ops


def api_key_check(api_key: str | None):
    expected = (api_key or "").encode()

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 expected):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer "
                           "<key>'", code="invalid_api_key")
    return check


async def read_body(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    """Parse and validate a JSON body of at most max_bytes: 415, 413 or 400 otherwise."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.split(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise APIError(415, f"Content-Type must be application/json, got {content_type!r}")
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise bad_request(f"invalid Content-Length {declared!r}")
    if declared is not None and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than {max_bytes} bytes",
                    code="request_too_large")


class _HttpGuard:
    """Answers an internal error with a 500 in OpenAI's shape instead of letting it reach
    uvicorn (which would drop the connection), and counts responses by endpoint and status
    (unknown paths count as 'other', so random URLs cannot blow up the label set)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = None

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except Exception as exc:
            if status is not None:
                raise  # the response has begun: nothing left to answer with
            logger.exception("internal error on %s %s", scope["method"], scope["path"])
            await internal_error(exc).response()(scope, receive, send_and_record)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.http_requests.labels(endpoint, str(status or 500)).inc()
