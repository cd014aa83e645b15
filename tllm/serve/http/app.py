"""The OpenAI-compatible HTTP server: FastAPI routes over one LLM (one executor loop shared
by all requests), API-key check, body limits, Prometheus metrics, health, a live dashboard,
and an OpenAPI schema built by FastAPI from the request and response models."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tllm import __version__
from tllm.serve.openai.chat import create_chat_completion
from tllm.serve.openai.completions import create_completion
from tllm.serve.context import SSE_CONTENT, ServerConfig, ServingContext
from tllm.serve.http.auth import SessionStore, install_api_key_guard
from tllm.serve.http.cors import install_cors
from tllm.serve.http.dashboard import dashboard_grant, dashboard_routes
from tllm.serve.disagg_worker import KVSourceHeader, disagg_routes
from tllm.serve.http.errors import (APIError, bad_request, error_responses,
                               from_validation_error, install_error_handlers, internal_error)
from tllm.serve.http.limits import install_request_limits
from tllm.serve.lora import lora_routes
from tllm.serve.http.rollout_routes import rollout_routes
from tllm.serve.http.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tllm.serve.openai.params import ModelLimits
from tllm.serve.openai.parser_choice import resolve_parsers
from tllm.serve.http.request_ids import RequestIdMiddleware
from tllm.serve.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                 CompletionRequest, CompletionResponse,
                                 HealthResponse, ModelCard, ModelList, VersionResponse)
from tllm.serve.openai.request_fields import check_fields, mark_ignored
from tllm.serve.openai.responses import responses_routes
from tllm.serve.pooling.engine_calls import GENERATE, needs_task
from tllm.serve.pooling.routes import POOLING_ENDPOINTS, pooling_routes

logger = logging.getLogger(__name__)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
             "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
             "/health", "/version",
             "/metrics", "/dashboard", "/dashboard/stats.json", "/openapi.json", "/docs",
             "/redoc", *POOLING_ENDPOINTS)


def build_app(llm, config: ServerConfig) -> FastAPI:
    """The server's ASGI app over a loaded LLM; the caller owns the LLM and shuts it down,
    and calls `app.state.ctx.close()` once the server has stopped."""
    config = resolve_parsers(config, getattr(llm, "tokenizer", None))  # `auto`: from the template
    ctx = ServingContext.create(llm, config)
    app = FastAPI(title="tllm", version=__version__, openapi_url=None, docs_url=None,
                  redoc_url=None, description="OpenAI-compatible completions and chat "
                  "completions, with vLLM's extra sampling fields; embeddings, score and "
                  "rerank for pooling models; tokenize and detokenize.")
    app.state.ctx = ctx
    app.state.drain = ctx.engine    # what the server's shutdown waits for, then ends
    app.state.sessions = sessions = SessionStore()
    install_error_handlers(app)
    # innermost first: the body is read only for a request that passed the key check
    install_request_limits(app, config.http_limits)
    install_api_key_guard(app, config.api_key, config.protect_metrics,
                          grants=[dashboard_grant(config.api_key, sessions)])
    app.add_middleware(_HttpGuard, metrics=ctx.metrics)
    app.add_middleware(RequestIdMiddleware)     # outermost: every response names its id
    app.include_router(_api_routes(ctx, ModelLimits.of(llm)))
    app.include_router(pooling_routes(ctx, ModelLimits.of(llm), [Depends(json_content_type)]))
    app.include_router(_ops_routes(ctx))
    app.include_router(_docs_routes(app))
    app.include_router(dashboard_routes(ctx, sessions))
    app.include_router(rollout_routes(llm, config.enable_sleep_mode, config.weight_update_dirs,
                                      [Depends(json_content_type)]))
    if getattr(llm, "disagg_info", None) is not None:
        app.include_router(disagg_routes(llm))
        app.add_middleware(KVSourceHeader, llm=llm)
    install_cors(app, config.allowed_origins)
    return app


def _api_routes(ctx: ServingContext, limits: ModelLimits) -> APIRouter:
    config = ctx.config
    api = APIRouter(prefix="/v1", responses=error_responses(401, 500))
    with_body = [Depends(json_content_type)]
    body_errors = error_responses(400, 404, 408, 413, 415, 429, 503)
    generates = [*with_body, needs_task(ctx, GENERATE)]     # 400 on a pooling model

    @api.post("/completions", dependencies=generates, summary="Create a completion",
              responses={200: {"model": CompletionResponse, "content": SSE_CONTENT,
                               "description": "The completion; with `stream`, its chunks"},
                         **body_errors})
    async def completions(request: Request, body: CompletionRequest) -> Response:
        ignored = check_fields(body, config.strict_request_fields)
        limits.check(body)
        return mark_ignored(await create_completion(ctx, request, body), ignored)

    @api.post("/chat/completions", dependencies=generates, summary="Create a chat completion",
              responses={200: {"model": ChatCompletionResponse, "content": SSE_CONTENT,
                               "description": "The chat completion; with `stream`, "
                               "ChatCompletionChunk events"}, **body_errors})
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        ignored = check_fields(body, config.strict_request_fields)
        limits.check(body)
        return mark_ignored(await create_chat_completion(ctx, request, body), ignored)

    @api.get("/models", summary="List the served model and its LoRA adapters",
             responses={200: {"model": ModelList}})
    async def models() -> Response:
        return JSONResponse(ModelList(data=_model_cards(ctx)).model_dump())

    # :path, as a served name may hold a slash (Qwen/Qwen3-8B)
    @api.get("/models/{model_id:path}", summary="Retrieve the served model or an adapter",
             responses={200: {"model": ModelCard}, **error_responses(404)})
    async def model(model_id: str) -> Response:
        card = next((card for card in _model_cards(ctx) if card.id == model_id), None)
        if card is None:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves "
                           f"{config.model_name!r}", param="model", code="model_not_found")
        return JSONResponse(card.model_dump())

    api.include_router(lora_routes(ctx.loras, with_body))

    api.include_router(responses_routes(ctx, limits, generates))
    return api


def _model_cards(ctx: ServingContext) -> list[ModelCard]:
    """The base model's card, then its adapters'. Names only: a server path (the model's, an
    adapter's folder) is no client's business."""
    name, max_len = ctx.config.model_name, ctx.llm.max_seq_len
    adapters = [ModelCard(id=lora.lora_name, root=lora.lora_name, parent=name,
                          max_model_len=max_len) for lora in ctx.loras.all()]
    return [ModelCard(id=name, root=name, max_model_len=max_len), *adapters]


def _ops_routes(ctx: ServingContext) -> APIRouter:
    ops = APIRouter(responses=error_responses(500))

    @ops.get("/health", summary="Engine health",
             responses={200: {"model": HealthResponse}, **error_responses(503)})
    async def health() -> Response:
        reason = ctx.engine.health()
        if reason is not None:
            return APIError(503, reason, code="engine_unhealthy").response()
        return JSONResponse(HealthResponse().model_dump())

    @ops.get("/version", summary="Server version", responses={200: {"model": VersionResponse}})
    async def version() -> Response:
        return JSONResponse(VersionResponse(version=__version__).model_dump())

    @ops.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}},
                        **error_responses(401)})
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return ops


def _docs_routes(app: FastAPI) -> APIRouter:
    """/openapi.json, /docs and /redoc (behind the API key with --protect-metrics)."""
    docs = APIRouter(include_in_schema=False)

    @docs.get("/openapi.json")
    async def openapi() -> Response:
        return JSONResponse(app.openapi())

    # The pages' scripts are served from the fastapi-offline package, not a CDN: the server
    # is often offline.
    @docs.get("/docs")
    async def swagger() -> Response:
        return get_swagger_ui_html(
            openapi_url="/openapi.json", title="tllm API",
            swagger_js_url=f"{_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{_ASSETS}/favicon.png")

    @docs.get("/redoc")
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title="tllm API",
                              redoc_js_url=f"{_ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{_ASSETS}/favicon.png", with_google_fonts=False)

    @docs.get(_ASSETS + "/{name}")
    async def docs_asset(name: str) -> Response:
        if name not in _DOCS_FILES:
            raise APIError(404, f"no docs asset {name!r}", code="not_found")
        return FileResponse(_docs_static() / name)

    return docs


_ASSETS = "/docs/assets"
_DOCS_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")


def _docs_static():
    from importlib.resources import files
    return files("fastapi_offline") / "static"


async def json_content_type(request: Request) -> None:
    """415 unless the body is JSON (no Content-Type at all is taken as JSON)."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.split(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise APIError(415, f"Content-Type must be application/json, got {content_type!r}")


async def read_body(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    """Parse and validate a JSON body of at most max_bytes: 415, 413 or 400 otherwise (for
    routes that parse their body themselves; the text routes let FastAPI do it)."""
    await json_content_type(request)
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
    """Answers an internal error with a 500 in OpenAI's shape (a request id, no exception
    text; the log has the exception under that id) instead of letting it reach uvicorn
    (which would drop the connection), and counts responses by endpoint and status
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
            await internal_error(exc).response()(scope, receive, send_and_record)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.http_requests.labels(endpoint, str(status or 500)).inc()
