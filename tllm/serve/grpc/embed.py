"""The Embed RPC: a request's inputs checked and embedded as /v1/embeddings does (the same
validation, limits, engine calls and metrics), the vectors as floats."""
from __future__ import annotations

from pydantic import ValidationError

from tllm.serve.context import ServingContext
from tllm.serve.grpc import tllm_pb2 as pb
from tllm.serve.http.errors import APIError, from_validation_error
from tllm.serve.openai.params import ModelLimits
from tllm.serve.pooling.embeddings import create_embeddings
from tllm.serve.pooling.engine_calls import check_task
from tllm.serve.pooling.protocol import EmbeddingRequest


async def embed(ctx: ServingContext, limits: ModelLimits,
                request: pb.EmbedRequest) -> pb.EmbedResponse:
    """The embeddings of the request's inputs; APIError (400 naming the field) otherwise."""
    check_task(ctx, "Embed", ("embed",))
    body = _as_body(request)
    answer = await create_embeddings(ctx, limits, None, body)
    return pb.EmbedResponse(embeddings=[pb.Embedding(values=item.embedding)
                                        for item in answer.data],
                            prompt_tokens=answer.usage.prompt_tokens)


def _as_body(request: pb.EmbedRequest) -> EmbeddingRequest:
    inputs = []
    for index, item in enumerate(request.inputs):
        which = item.WhichOneof("input")
        if which is None:
            raise APIError(400, f"inputs[{index}]: give text or token_ids", param="inputs")
        inputs.append(item.text if which == "text" else list(item.token_ids.ids))
    fields = {"input": inputs}
    if request.HasField("dimensions"):
        fields["dimensions"] = request.dimensions
    try:
        return EmbeddingRequest.model_validate(fields)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
