"""POST /classify (vLLM's shape; /v1/classify too) for classification and reward models: each
input's probabilities over the model's labels, and the likeliest label."""
from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, WithJsonSchema, field_validator
from starlette.requests import Request

from tllm.pooling_params import PoolingParams
from tllm.serve.context import ServingContext
from tllm.serve.openai.params import ModelLimits
from tllm.serve.openai.protocol import TokenIds, _Body, _Response
from tllm.serve.pooling.engine_calls import (check_base_model, num_tokens, run_all,
                                             token_inputs)
from tllm.serve.pooling.protocol import (_INPUT_SCHEMA, EmbeddingRequest, PoolingUsage,
                                         _now, new_id)


class ClassificationRequest(_Body):
    """POST /classify: the inputs as /v1/embeddings takes them."""

    model: Optional[str] = None
    input: Annotated[str | list[Any], WithJsonSchema(_INPUT_SCHEMA)]
    user: Optional[str] = Field(None, description="ignored")

    @field_validator("input")
    @classmethod
    def _input_form(cls, value):
        return EmbeddingRequest._input_form(value)

    def inputs(self) -> list[str | TokenIds]:
        """The input as a list of inputs, each text or token ids."""
        return EmbeddingRequest.inputs(self)


class ClassificationData(_Response):
    object: Literal["classification"] = "classification"
    index: int
    label: str = Field(description="the likeliest label")
    probs: list[float] = Field(description="one probability per label, in the model's order")
    num_classes: int


class ClassificationResponse(_Response):
    id: str = Field(default_factory=lambda: new_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


async def create_classification(ctx: ServingContext, limits: ModelLimits, request: Request,
                                body: ClassificationRequest) -> ClassificationResponse:
    check_base_model(ctx, body.model)
    token_ids = await token_inputs(ctx, limits, body.inputs(), "input")
    params = PoolingParams(task="classify")
    calls = [functools.partial(ctx.llm.encode_async, {"prompt_token_ids": ids}, params)
             for ids in token_ids]
    outputs = await run_all(ctx, request, calls, "input")
    labels = (getattr(ctx.llm, "pooling_info", None) or {}).get("labels")
    data = [_classified(index, [float(p) for p in output.probs], labels)
            for index, output in enumerate(outputs)]
    return ClassificationResponse(model=body.model or ctx.config.model_name, data=data,
                                  usage=PoolingUsage(prompt_tokens=num_tokens(outputs)))


def _classified(index: int, probs: list[float], labels: list[str] | None) -> ClassificationData:
    best = max(range(len(probs)), key=probs.__getitem__)
    # without names from the model, HF's default id2label names
    label = labels[best] if labels and best < len(labels) else f"LABEL_{best}"
    return ClassificationData(index=index, label=label, probs=probs, num_classes=len(probs))
