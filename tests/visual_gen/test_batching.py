"""VisualGen.generate_batch on a tiny random Qwen-Image (fp32, CPU): requests of different
prompts, seeds, negative prompts and image counts in one transformer batch each get the
images they get alone; only compatible requests batch; a request that fails before the batch
runs fails alone."""
from __future__ import annotations

import numpy as np
import pytest

from tests.visual_gen.conftest import max_relative_error
from tllm.visual_gen import VisualGenParams
from tllm.visual_gen.batching import ImageRequest, batch_key

COMMON = dict(height=32, width=48, num_inference_steps=2, true_cfg_scale=2.5,
              return_latents=True)
REQUESTS = [
    ImageRequest("a cat", VisualGenParams(seed=1, negative_prompt=" ", **COMMON)),
    ImageRequest("a red fox in the snow at night", VisualGenParams(
        seed=7, num_images_per_prompt=2, negative_prompt="blurry", **COMMON)),
    ImageRequest("a dog", VisualGenParams(seed=3, negative_prompt=" ", **COMMON)),
]


@pytest.fixture(scope="module")
def alone_outputs():
    """Each request's output alone, made once."""
    return {}


def assert_same_as_alone(gen, request: ImageRequest, output, cache=None) -> None:
    cache = {} if cache is None else cache
    if request not in cache:
        cache[request] = gen.generate(request.prompt, request.params)
    alone = cache[request]
    assert output.seeds == alone.seeds
    # Not bitwise: the batch pads prompts to the longest (masked attention), which rounds
    # differently in the last bits; the 8-bit images came out identical in our runs.
    assert max_relative_error(output.latents, alone.latents) <= 1e-6
    assert len(output.images) == len(alone.images)
    for batched, single in zip(output.images, alone.images):
        difference = np.asarray(batched, np.int16) - np.asarray(single, np.int16)
        assert np.abs(difference).max() <= 1


@pytest.mark.parametrize("num_requests", [2, 3])
def test_each_request_gets_the_images_it_gets_alone(visual_gen, alone_outputs, num_requests):
    requests = REQUESTS[:num_requests]
    outputs = visual_gen.generate_batch(requests)
    assert len(outputs) == num_requests
    for request, output in zip(requests, outputs):
        assert_same_as_alone(visual_gen, request, output, alone_outputs)


def test_without_guidance_and_latents_kept_only_where_asked(visual_gen):
    params = VisualGenParams(height=32, width=32, num_inference_steps=1, seed=5)
    requests = [ImageRequest("a cat", params),
                ImageRequest("a boat on a lake", VisualGenParams(
                    height=32, width=32, num_inference_steps=1, seed=9, return_latents=True))]
    first, second = visual_gen.generate_batch(requests)
    assert first.latents is None and second.latents is not None
    assert_same_as_alone(visual_gen, requests[1], second)


def test_batch_key_names_what_must_match():
    base = VisualGenParams(**COMMON, seed=1, negative_prompt="x")
    same = [VisualGenParams(**COMMON, seed=2, negative_prompt="y", num_images_per_prompt=3),
            VisualGenParams(**{**COMMON, "return_latents": False}, negative_prompt="x")]
    differ = [VisualGenParams(**{**COMMON, "height": 64}, negative_prompt="x"),
              VisualGenParams(**{**COMMON, "num_inference_steps": 3}, negative_prompt="x"),
              VisualGenParams(**{**COMMON, "true_cfg_scale": 3.0}, negative_prompt="x"),
              VisualGenParams(**COMMON),      # no negative prompt: no guidance
              VisualGenParams(**COMMON, negative_prompt="x", cfg_normalize=False)]
    assert all(batch_key(p) == batch_key(base) for p in same)
    assert all(batch_key(p) != batch_key(base) for p in differ)


def test_incompatible_requests_are_refused(visual_gen):
    with pytest.raises(ValueError, match="cannot batch"):
        visual_gen.generate_batch([REQUESTS[0], ImageRequest("a cat", VisualGenParams(
            **{**COMMON, "num_inference_steps": 3}))])
    with pytest.raises(ValueError, match="requests"):
        visual_gen.generate_batch([])


def test_a_request_that_fails_before_the_batch_fails_alone(visual_gen, alone_outputs,
                                                         monkeypatch):
    pipeline = visual_gen.pipeline
    encode = pipeline.text_embeds

    def text_embeds(prompts, params):
        if prompts == ["broken"]:
            raise ValueError("prompt: cannot encode")
        return encode(prompts, params)

    monkeypatch.setattr(pipeline, "text_embeds", text_embeds)
    broken = ImageRequest("broken", REQUESTS[0].params)
    outputs = visual_gen.generate_batch([REQUESTS[0], broken, REQUESTS[2]])
    (alone,) = visual_gen.generate_batch([broken])
    monkeypatch.undo()
    assert isinstance(outputs[1], ValueError) and isinstance(alone, ValueError)
    assert_same_as_alone(visual_gen, REQUESTS[0], outputs[0], alone_outputs)
    assert_same_as_alone(visual_gen, REQUESTS[2], outputs[2], alone_outputs)
