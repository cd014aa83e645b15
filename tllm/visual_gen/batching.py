"""Several image requests in one pipeline call: each request's prompt is checked and encoded
on its own (a failure fails only that request), their images' noise is drawn from each
request's own seeds, and all of them go through the denoising loop as one transformer batch.

A request gets the image it gets alone: the same text states and the same noise; what may
differ is float rounding where the batch pads prompts to the longest (a masked transformer
batch) or a kernel picks another blocking for the larger batch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Hashable, Sequence

from tllm.visual_gen.params import VisualGenParams
from tllm.visual_gen.pipeline import DenoiseHook, TextEmbeds, VisualGenOutput, image_seeds

# What may differ between the requests of one batch; every other field of VisualGenParams
# (size, steps, guidance, output type and any option added later) must match.
PER_REQUEST_FIELDS = frozenset({"seed", "negative_prompt", "num_images_per_prompt",
                                "return_latents"})


@dataclass(frozen=True)
class ImageRequest:
    """One request of a batch: its prompt and parameters."""

    prompt: str
    params: VisualGenParams


@dataclass
class _Prepared:
    request: ImageRequest
    embeds: TextEmbeds
    seeds: list[int]


def can_batch(pipeline: Any) -> bool:
    """Whether the pipeline generates from text states (text-to-image pipelines that take no
    input image)."""
    return hasattr(pipeline, "generate_from_embeds") and not pipeline.takes_image


def batch_key(params: VisualGenParams) -> Hashable:
    """Requests whose keys are equal can share one transformer batch."""
    shared = tuple((f.name, getattr(params, f.name)) for f in fields(params)
                   if f.name not in PER_REQUEST_FIELDS)
    return shared + (("is_cfg", params.is_cfg),)


def generate_batch(pipeline: Any, requests: Sequence[ImageRequest],
                   hooks: Sequence[DenoiseHook] = ()) -> list[VisualGenOutput | Exception]:
    """Each request's output, or the exception its preprocessing raised, in order. The
    requests must share a batch_key (ValueError otherwise)."""
    if not requests:
        raise ValueError("requests must not be empty")
    if len({batch_key(r.params) for r in requests}) > 1:
        raise ValueError("requests differ in more than prompt, seed, negative_prompt, "
                         "num_images_per_prompt and return_latents: they cannot batch")
    results: list[_Prepared | Exception] = [_prepare(pipeline, r) for r in requests]
    prepared = [r for r in results if isinstance(r, _Prepared)]
    if not prepared:
        return results      # type: ignore[return-value]   (all exceptions)
    outputs = iter(_split(_run(pipeline, prepared, hooks), prepared))
    return [r if isinstance(r, Exception) else next(outputs) for r in results]


def _prepare(pipeline: Any, request: ImageRequest) -> _Prepared | Exception:
    params = request.params
    try:
        pipeline.check_request(params, None, [request.prompt])
        seeds = image_seeds(params.seed, params.num_images_per_prompt)
        return _Prepared(request, pipeline.text_embeds([request.prompt], params), seeds)
    except Exception as exc:        # noqa: BLE001  (this request's failure only)
        return exc


def _run(pipeline: Any, prepared: list[_Prepared],
         hooks: Sequence[DenoiseHook]) -> VisualGenOutput:
    cond = [s for p in prepared for s in p.embeds.cond]
    has_uncond = prepared[0].embeds.uncond is not None
    uncond = [s for p in prepared for s in p.embeds.uncond] if has_uncond else None
    seeds = [s for p in prepared for s in p.seeds]
    params = replace(prepared[0].request.params,
                     return_latents=any(p.request.params.return_latents for p in prepared))
    return pipeline.generate_from_embeds(TextEmbeds(cond, uncond), seeds, params, hooks)


def _split(output: VisualGenOutput, prepared: list[_Prepared]) -> list[VisualGenOutput]:
    """The batch's output cut back into each request's."""
    outputs, start = [], 0
    for p in prepared:
        stop = start + len(p.seeds)
        params = p.request.params
        keeps_latents = params.return_latents or params.output_type == "latent"
        latents = output.latents[start:stop] if keeps_latents else None
        outputs.append(VisualGenOutput(output.images[start:stop], latents, p.seeds))
        start = stop
    return outputs
