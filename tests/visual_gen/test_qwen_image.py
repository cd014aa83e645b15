"""Our Qwen-Image pipeline against diffusers' QwenImagePipeline on the same tiny random
weights: latents after 4 steps, decoded images, seeds and batching; on both our transformer
and diffusers' (behind our forward)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.visual_gen.conftest import max_relative_error
from tllm.visual_gen import VisualGen, VisualGenParams

PROMPT = "a cat holding a sign that says hello world"
HEIGHT, WIDTH, STEPS = 32, 48, 4


@pytest.fixture(scope="session")
def diffusers_impl_gen(qwen_image_dir):
    return VisualGen(str(qwen_image_dir), device="cpu", transformer_impl="diffusers",
                     show_progress=False)


def reference_run(pipe, prompt, seed: int, **kwargs):
    """diffusers' final latents (packed) and images (float, [0, 1], NHWC)."""
    seen = {}

    def keep_latents(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    images = pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np",
                  callback_on_step_end=keep_latents, **kwargs).images
    return seen["latents"], images


@pytest.mark.parametrize("negative_prompt", [None, "blurry"], ids=["no-cfg", "true-cfg"])
@pytest.mark.parametrize("impl", ["tllm", "diffusers"])
def test_matches_diffusers(reference, visual_gen, diffusers_impl_gen, impl, negative_prompt):
    gen = visual_gen if impl == "tllm" else diffusers_impl_gen
    ref_latents, ref_images = reference_run(
        reference, PROMPT, seed=11, negative_prompt=negative_prompt, true_cfg_scale=3.0,
        height=HEIGHT, width=WIDTH, num_inference_steps=STEPS)
    params = VisualGenParams(height=HEIGHT, width=WIDTH, num_inference_steps=STEPS, seed=11,
                             negative_prompt=negative_prompt, true_cfg_scale=3.0,
                             return_latents=True)
    out = gen.generate(PROMPT, params)
    assert out.seeds == [11]
    assert max_relative_error(out.latents, ref_latents) <= 1e-4
    images = gen.pipeline.decode(out.latents, HEIGHT, WIDTH).permute(0, 2, 3, 1).numpy()
    assert np.abs(images - ref_images).max() <= 1e-3
    (image,) = out.images
    assert image.size == (WIDTH, HEIGHT) and image.mode == "RGB"
    pixels = np.asarray(image).astype(np.int16)
    assert np.abs(pixels - np.round(ref_images[0] * 255)).max() <= 1


def test_uses_our_transformer_by_default(visual_gen):
    from tllm.visual_gen.models.qwen_image.transformer import QwenImageTransformer
    assert isinstance(visual_gen.pipeline.transformer, QwenImageTransformer)


def test_same_seed_same_image(visual_gen):
    params = VisualGenParams(height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=3)
    first, second = visual_gen.generate("a red fox", params), visual_gen.generate("a red fox",
                                                                                  params)
    assert np.array_equal(np.asarray(first.images[0]), np.asarray(second.images[0]))
    other = visual_gen.generate("a red fox", VisualGenParams(
        height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=4))
    assert not np.array_equal(np.asarray(first.images[0]), np.asarray(other.images[0]))


def test_batch_equals_separate_runs(visual_gen):
    # Prompts of different lengths, so the batch pads (and masks) text; image i uses seed + i.
    prompts = ["a cat", "a red fox in the snow at night"]
    common = dict(height=HEIGHT, width=WIDTH, num_inference_steps=3, negative_prompt=" ",
                  true_cfg_scale=2.5, return_latents=True)
    batch = visual_gen.generate(prompts, VisualGenParams(
        seed=5, num_images_per_prompt=2, **common))
    assert batch.seeds == [5, 6, 7, 8] and len(batch.images) == 4
    for i, prompt in enumerate([prompts[0]] * 2 + [prompts[1]] * 2):
        alone = visual_gen.generate(prompt, VisualGenParams(seed=5 + i, **common))
        assert max_relative_error(batch.latents[i:i + 1], alone.latents) <= 1e-4


def test_latent_output(visual_gen):
    out = visual_gen.generate(PROMPT, VisualGenParams(
        height=HEIGHT, width=WIDTH, num_inference_steps=1, seed=0, output_type="latent"))
    assert out.images == []
    channels = visual_gen.pipeline.latent_channels * 4
    assert out.latents.shape == (1, (HEIGHT // 8) * (WIDTH // 8), channels)


def test_model_rules(visual_gen, rgba_image):
    with pytest.raises(ValueError, match=r"VisualGenParams\.layers"):
        visual_gen.generate(PROMPT, VisualGenParams(layers=2))
    with pytest.raises(ValueError, match="text only"):
        visual_gen.generate(PROMPT, VisualGenParams(), image=rgba_image)
    with pytest.raises(ValueError, match="prompt"):
        visual_gen.generate([], VisualGenParams())


def test_hooks_see_every_step_and_are_freed(visual_gen):
    from tllm.visual_gen.pipeline import DenoiseHook

    class Recorder(DenoiseHook):
        def __init__(self, stop_at=None):
            self.events, self.stop_at = [], stop_at

        def prepare(self, step):
            if step.index == self.stop_at:
                raise KeyboardInterrupt
            self.events.append(("prepare", step.index, step.num_steps))

        def update(self, step):
            self.events.append(("update", step.index, tuple(step.latents.shape)))

        def free(self):
            self.events.append(("free",))

    params = VisualGenParams(height=16, width=16, num_inference_steps=2, seed=0)
    hook = Recorder()
    visual_gen.generate("a cat", params, hooks=[hook])
    shape = (1, 4, visual_gen.pipeline.latent_channels * 4)
    assert hook.events == [("prepare", 0, 2), ("update", 0, shape), ("prepare", 1, 2),
                           ("update", 1, shape), ("free",)]
    stopping = Recorder(stop_at=1)     # e.g. a cancelled request
    with pytest.raises(KeyboardInterrupt):
        visual_gen.generate("a cat", params, hooks=[stopping])
    assert stopping.events[-1] == ("free",)
