"""POST /v1/score (vLLM's: 1:N and N:N pairs of texts) and POST /v1/rerank, /v2/rerank (Jina's
and Cohere's: a query, documents, the best top_n by relevance). A cross-encoder scores each
pair; an embedding model, the cosine of the two texts' embeddings (the engine's score_async)."""
from __future__ import annotations

import functools

from starlette.requests import Request

from tllm.outputs import PoolingRequestOutput
from tllm.serve.context import ServingContext
from tllm.serve.http.errors import bad_request
from tllm.serve.pooling.engine_calls import (check_base_model, check_count, check_texts,
                                             num_tokens, run_all)
from tllm.serve.pooling.protocol import (PoolingUsage, RerankRequest, RerankResponse,
                                         RerankResult, RerankResultDocument, ScoreData,
                                         ScoreRequest, ScoreResponse)


async def create_score(ctx: ServingContext, request: Request,
                       body: ScoreRequest) -> ScoreResponse:
    check_base_model(ctx, body.model)
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise bad_request(f"text_2: {len(seconds)} texts for the {len(firsts)} of text_1; "
                          "send one text_1 for any number of text_2 (1:N), or two lists of "
                          "one length (N:N)", param="text_2")
    check_count(len(seconds), "text_2", ctx)
    check_texts(firsts, "text_1")
    check_texts(seconds, "text_2")
    if len(firsts) == 1:
        outputs = await _scores(ctx, request, firsts[0], seconds, "text_2")
    else:   # N:N: one pair per call, all at once
        calls = [functools.partial(ctx.llm.score_async, first, [second])
                 for first, second in zip(firsts, seconds)]
        outputs = [pair[0] for pair in await run_all(ctx, request, calls, "text_2")]
    data = [ScoreData(index=index, score=output.score) for index, output in enumerate(outputs)]
    return ScoreResponse(model=body.model or ctx.config.model_name, data=data,
                         usage=PoolingUsage(prompt_tokens=num_tokens(outputs)))


async def create_rerank(ctx: ServingContext, request: Request,
                        body: RerankRequest) -> RerankResponse:
    check_base_model(ctx, body.model)
    documents = body.texts()
    check_count(len(documents), "documents", ctx)
    check_texts([body.query], "query")
    check_texts(documents, "documents")
    outputs = await _scores(ctx, request, body.query, documents, "documents")
    # stable: documents of one score keep their order
    ranked = sorted(range(len(documents)), key=lambda index: -outputs[index].score)
    results = [RerankResult(index=index, relevance_score=outputs[index].score,
                            document=(RerankResultDocument(text=documents[index])
                                      if body.return_documents else None))
               for index in ranked[:body.top_n or None]]
    return RerankResponse(model=body.model or ctx.config.model_name, results=results,
                          usage=PoolingUsage(prompt_tokens=num_tokens(outputs)))


async def _scores(ctx: ServingContext, request: Request, query: str, documents: list[str],
                  param: str) -> list[PoolingRequestOutput]:
    """One score per document, in their order (the engine batches the pairs)."""
    [outputs] = await run_all(
        ctx, request, [functools.partial(ctx.llm.score_async, query, documents)], param,
        num_inputs=len(documents))
    return outputs
