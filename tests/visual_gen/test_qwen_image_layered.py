"""Our Qwen-Image-Layered pipeline against diffusers' QwenImageLayeredPipeline on the same
tiny random weights, at diffusers' smallest bucket (resolution 640)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.visual_gen.conftest import max_relative_error
from tests.visual_gen.tiny_models import TinyVLProcessor
from tllm.visual_gen import VisualGenParams
from tllm.visual_gen.models.qwen_image.layered_pipeline import bucket_size
from tllm.visual_gen.pipeline import to_pil

CAPTION = "a cat holding a sign"
LAYERS, STEPS = 1, 3


def reference_run(pipe, image, seed: int, prompt: str | None = CAPTION, **kwargs):
    """diffusers' final latents (packed; its output_type="latent" is broken for this
    pipeline) and RGBA layers (float, [0, 1])."""
    seen = {}

    def keep_latents(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    layers = pipe(image, prompt, generator=torch.Generator().manual_seed(seed),
                  output_type="np", callback_on_step_end=keep_latents, **kwargs).images[0]
    return seen["latents"], layers


@pytest.mark.parametrize("negative_prompt, cfg_normalize",
                         [(None, None), (" ", None), ("blurry", True)],
                         ids=["no-cfg", "true-cfg", "true-cfg-normalized"])
def test_matches_diffusers(layered_reference, layered_gen, rgba_image, negative_prompt,
                           cfg_normalize):
    ref_latents, ref_layers = reference_run(
        layered_reference, rgba_image, seed=2, negative_prompt=negative_prompt,
        true_cfg_scale=3.0, cfg_normalize=bool(cfg_normalize), layers=LAYERS, resolution=640,
        num_inference_steps=STEPS)
    params = VisualGenParams(num_inference_steps=STEPS, seed=2, layers=LAYERS,
                             negative_prompt=negative_prompt, true_cfg_scale=3.0,
                             cfg_normalize=cfg_normalize, output_type="latent")
    out = layered_gen.generate(CAPTION, params, image=rgba_image)
    assert max_relative_error(out.latents, ref_latents) <= 1e-4
    height, width = bucket_size(rgba_image.size, 640)
    (layers,) = layered_gen.pipeline.decode_layers(out.latents, LAYERS, height, width)
    assert np.abs(layers.permute(0, 2, 3, 1).numpy() - ref_layers).max() <= 1e-3
    pil_layers = to_pil(layers)
    assert all(layer.mode == "RGBA" and layer.size == (width, height) for layer in pil_layers)


@pytest.mark.parametrize("language", ["en", "zh"])
def test_an_empty_prompt_is_captioned_as_diffusers_does(layered_reference, layered_gen,
                                                        rgba_image, language):
    """The text encoder writes the caption (greedy, up to 512 tokens) through the model's
    processor; the same caption must condition both pipelines."""
    processor = TinyVLProcessor(layered_gen.pipeline.tokenizer)
    layered_reference.vl_processor = processor
    pipeline = layered_gen.pipeline
    pipeline.processor = processor
    filled = []  # what generate's own fill_captions returned (no third captioning run)

    def fill_captions(prompts, images, lang):
        filled.append(type(pipeline).fill_captions(pipeline, prompts, images, lang))
        return filled[-1]

    pipeline.fill_captions = fill_captions
    try:
        ref_latents, _ = reference_run(
            layered_reference, rgba_image, seed=1, prompt=None, layers=LAYERS, resolution=640,
            num_inference_steps=2, use_en_prompt=language == "en")
        params = VisualGenParams(num_inference_steps=2, seed=1, layers=LAYERS,
                                 output_type="latent", caption_language=language)
        out = layered_gen.generate(" ", params, image=rgba_image)
        (caption,), = filled
        # a given caption is kept (no captioning: quick)
        given = fill_captions([CAPTION], [rgba_image], language)
    finally:
        layered_reference.vl_processor = pipeline.processor = None
        del pipeline.fill_captions
    assert max_relative_error(out.latents, ref_latents) <= 1e-4
    assert caption.strip() and given == [CAPTION]


def test_needs_an_image_and_a_caption(layered_gen, rgba_image):
    with pytest.raises(ValueError, match="image"):
        layered_gen.generate(CAPTION, VisualGenParams())
    with pytest.raises(ValueError, match="caption"):    # no processor: no automatic caption
        layered_gen.generate(" ", VisualGenParams(), image=rgba_image)
    with pytest.raises(ValueError, match="caption_language"):
        VisualGenParams(caption_language="fr")
    with pytest.raises(ValueError, match=r"VisualGenParams\.height"):
        layered_gen.generate(CAPTION, VisualGenParams(height=64), image=rgba_image)
    with pytest.raises(ValueError, match="one per prompt"):
        layered_gen.generate([CAPTION] * 3, VisualGenParams(), image=[rgba_image] * 2)
