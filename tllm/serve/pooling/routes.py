"""The routes of pooling models (/v1/embeddings for the embed task; /v1/score, /v1/rerank and
/v2/rerank for the score task, or embed: the cosine of embeddings; /classify and
/v1/classify for the classify task) and the token routes of
every model (/tokenize, /detokenize). A route of another task answers 400 naming the task."""
from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tllm.serve.context import ServingContext
from tllm.serve.http.errors import error_responses
from tllm.serve.openai.params import ModelLimits
from tllm.serve.openai.request_fields import check_fields, mark_ignored
from tllm.serve.pooling.classify import (ClassificationRequest, ClassificationResponse,
                                         create_classification)
from tllm.serve.pooling.embeddings import create_embeddings
from tllm.serve.pooling.engine_calls import needs_task
from tllm.serve.pooling.protocol import (DetokenizeRequest, DetokenizeResponse,
                                         EmbeddingRequest, EmbeddingResponse, RerankRequest,
                                         RerankResponse, ScoreRequest, ScoreResponse,
                                         TokenizeRequest, TokenizeResponse)
from tllm.serve.pooling.scores import create_rerank, create_score
from tllm.serve.pooling.tokens import detokenize, tokenize

POOLING_ENDPOINTS = ("/v1/embeddings", "/v1/score", "/v1/rerank", "/v2/rerank", "/classify",
                     "/v1/classify", "/tokenize", "/detokenize")


def pooling_routes(ctx: ServingContext, limits: ModelLimits, with_body: list) -> APIRouter:
    """The routes above; `with_body`: the dependencies of a route with a JSON body."""
    router = APIRouter(responses=error_responses(401, 500))
    body_errors = error_responses(400, 404, 408, 413, 415, 503)
    strict = ctx.config.strict_request_fields

    def answer(response, ignored: list[str]) -> Response:
        return mark_ignored(JSONResponse(response.model_dump()), ignored)

    @router.post("/v1/embeddings", dependencies=[*with_body, needs_task(ctx, "embed")],
                 summary="Create embeddings (embed models)",
                 responses={200: {"model": EmbeddingResponse}, **body_errors})
    async def embeddings(request: Request, body: EmbeddingRequest) -> Response:
        ignored = check_fields(body, strict)
        return answer(await create_embeddings(ctx, limits, request, body), ignored)

    scoring = [*with_body, needs_task(ctx, "score", "embed")]

    @router.post("/v1/score", dependencies=scoring,
                 summary="Score text pairs, 1:N or N:N (score and embed models)",
                 responses={200: {"model": ScoreResponse}, **body_errors})
    async def score(request: Request, body: ScoreRequest) -> Response:
        ignored = check_fields(body, strict)
        return answer(await create_score(ctx, request, body), ignored)

    for path in ("/v1/rerank", "/v2/rerank"):
        @router.post(path, dependencies=scoring, summary="Rank documents by relevance to a "
                     "query (score and embed models)",
                     responses={200: {"model": RerankResponse}, **body_errors})
        async def rerank(request: Request, body: RerankRequest) -> Response:
            ignored = check_fields(body, strict)
            return answer(await create_rerank(ctx, request, body), ignored)

    for path in ("/classify", "/v1/classify"):
        @router.post(path, dependencies=[*with_body, needs_task(ctx, "classify")],
                     summary="Classify inputs (classification and reward models)",
                     responses={200: {"model": ClassificationResponse}, **body_errors})
        async def classify(request: Request, body: ClassificationRequest) -> Response:
            ignored = check_fields(body, strict)
            return answer(await create_classification(ctx, limits, request, body), ignored)

    @router.post("/tokenize", dependencies=with_body,
                 summary="Tokenize a prompt or chat messages",
                 responses={200: {"model": TokenizeResponse}, **body_errors})
    async def tokenize_route(body: TokenizeRequest) -> Response:
        ignored = check_fields(body, strict)
        return answer(await tokenize(ctx, body), ignored)

    @router.post("/detokenize", dependencies=with_body, summary="Decode token ids",
                 responses={200: {"model": DetokenizeResponse}, **body_errors})
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        ignored = check_fields(body, strict)
        return answer(await detokenize(ctx, limits, body), ignored)

    return router
