"""POST /v1/embeddings: inputs as texts or token ids, vectors as floats or base64
(little-endian float32, as OpenAI's), Matryoshka `dimensions`."""
from __future__ import annotations

import base64
import functools

import numpy as np

from starlette.requests import Request

from tllm.outputs import PoolingRequestOutput
from tllm.pooling_params import PoolingParams
from tllm.serve.context import ServingContext
from tllm.serve.http.errors import bad_request
from tllm.serve.openai.params import ModelLimits
from tllm.serve.pooling.engine_calls import (check_base_model, num_tokens, run_all,
                                             token_inputs)
from tllm.serve.pooling.protocol import (EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                         PoolingUsage)


async def create_embeddings(ctx: ServingContext, limits: ModelLimits, request: Request | None,
                            body: EmbeddingRequest) -> EmbeddingResponse:
    """The embeddings (`request`: the HTTP request whose disconnect cancels them; None for
    a gRPC call)."""
    check_base_model(ctx, body.model)
    _check_dimensions(ctx, body.dimensions)
    token_ids = await token_inputs(ctx, limits, body.inputs(), "input")
    params = PoolingParams(task="embed", dimensions=body.dimensions)
    calls = [functools.partial(ctx.llm.encode_async, {"prompt_token_ids": ids}, params)
             for ids in token_ids]
    outputs = await run_all(ctx, request, calls, "input")
    data = [EmbeddingData(index=index, embedding=_encoded(output, body.encoding_format))
            for index, output in enumerate(outputs)]
    return EmbeddingResponse(model=body.model or ctx.config.model_name, data=data,
                             usage=PoolingUsage(prompt_tokens=num_tokens(outputs)))


def _check_dimensions(ctx: ServingContext, dimensions: int | None) -> None:
    size = (getattr(ctx.llm, "pooling_info", None) or {}).get("embedding_size")
    if dimensions is not None and size is not None and dimensions > size:
        raise bad_request(f"dimensions: {dimensions} is more than the model's embedding size "
                          f"({size})", param="dimensions")


def _encoded(output: PoolingRequestOutput, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        vector = np.asarray(output.embedding, dtype="<f4")
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return [float(value) for value in output.embedding]
