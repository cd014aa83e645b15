"""Cosmos 3 against diffusers on the same tiny random weights: the transformer (fp32,
relative error <= 1e-5, with and without sound tokens and the text-norm variants), the
pipeline's latents after a few steps (<= 1e-4, with and without guidance, text-to-video and
image-to-video) and the decoded frames (<= 1e-3); the same seed gives the same video."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.visual_gen.tiny_cosmos import diffusers_cosmos, tiny_transformer
from tllm.visual_gen.models.cosmos3.components import chat_tokenizer
from tllm.visual_gen.models.cosmos3.diffusers_transformer import DiffusersCosmos3
from tllm.visual_gen.models.cosmos3.rope import JointLayout, MultimodalRope
from tllm.visual_gen.models.cosmos3.transformer import (Cosmos3Config, Cosmos3Transformer,
                                                        GenTokens)
from tllm.visual_gen.params import VisualGenParams

FRAMES, HEIGHT, WIDTH = 9, 48, 64       # 3 latent frames of 3 x 4 (patches: 2 x 2)
STEPS = 3


def _relative(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(scope="module")
def reference(cosmos_dir):
    return diffusers_cosmos(cosmos_dir)


@pytest.fixture(scope="module")
def gen(cosmos_gen):
    return cosmos_gen


def _layout(config, num_text: int, num_gen: int, seed: int) -> JointLayout:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (num_text,), generator=gen)
    positions = torch.cat([torch.arange(num_text).float().expand(3, -1),
                           (torch.rand(3, num_gen, generator=gen) * 40).round()], dim=1)
    rope = MultimodalRope(config.head_dim, config.rope_theta, tuple(config.rope_axes_dim))
    return JointLayout(ids, positions, *rope.tables(positions, "cpu"))


@pytest.mark.parametrize("variant", [
    dict(), dict(sound_gen=True, sound_dim=6), dict(qk_norm_for_text=False),
    dict(qk_norm_for_text=False, use_und_k_norm_for_gen=True), dict(hidden_act="relu2"),
    dict(attention_bias=True)], ids=lambda v: ",".join(v) or "default")
def test_transformer_equals_diffusers(variant):
    torch.manual_seed(0)
    tokenizer = chat_tokenizer("a b c d e f", vocab_size=280)
    theirs = tiny_transformer(tokenizer, **variant)
    ours = Cosmos3Transformer(Cosmos3Config.from_dict(theirs.config))
    ours.load_diffusers_state_dict(theirs.state_dict())
    vision = torch.randn(4, 3, 3, 5)       # odd width: padded to the patch
    sound = torch.randn(6, 7) if variant.get("sound_gen") else None
    num_gen = 3 * 2 * 3 + (0 if sound is None else 7)
    layouts = [_layout(ours.config, 9, num_gen, 1), _layout(ours.config, 14, num_gen, 2)]
    gen = GenTokens(vision, sound, noisy_frames=[1, 2])
    got_vision, got_sound = ours(gen, 731, layouts)
    want_vision, want_sound = DiffusersCosmos3(theirs)(gen, 731, layouts)
    assert got_vision.shape == (2, 4, 3, 3, 5)
    assert torch.equal(got_vision[:, :, 0], torch.zeros_like(got_vision[:, :, 0]))
    assert _relative(got_vision, want_vision) <= 1e-5
    if sound is not None:
        assert _relative(got_sound, want_sound) <= 1e-5
    # our weights back under diffusers' names give diffusers' model again
    again = DiffusersCosmos3.from_ours(ours)
    assert _relative(again(gen, 731, layouts)[0], want_vision) <= 1e-5


def _reference_run(reference, seed: int, **kwargs):
    seen = {}

    def keep_latents(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    frames = reference(num_frames=FRAMES, height=HEIGHT, width=WIDTH,
                       num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                       output_type="np", callback_on_step_end=keep_latents,
                       enable_safety_check=False, **kwargs).video
    return seen["latents"], frames


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_pipeline_equals_diffusers(reference, gen, guidance):
    prompt, negative = "a red fox runs in the snow", "blurry"
    ref_latents, ref_frames = _reference_run(reference, 7, prompt=prompt,
                                             negative_prompt=negative, guidance_scale=guidance)
    params = VisualGenParams(num_frames=FRAMES, height=HEIGHT, width=WIDTH,
                             num_inference_steps=STEPS, guidance_scale=guidance,
                             negative_prompt=negative, seed=7, return_latents=True)
    out = gen.generate(prompt, params)
    assert _relative(out.latents, ref_latents) <= 1e-4
    frames = gen.pipeline.decode(out.latents).numpy()
    assert frames.shape == ref_frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert np.abs(frames - ref_frames).max() <= 1e-3
    assert out.videos[0].dtype == np.uint8 and out.videos[0].shape == frames.shape
    assert out.frame_rate == 24.0


def test_image_to_video_equals_diffusers(reference, gen):
    from PIL import Image
    image = Image.fromarray((np.random.RandomState(0).rand(40, 70, 3) * 255).astype(np.uint8))
    ref_latents, _ = _reference_run(reference, 3, prompt="the fox turns", image=image,
                                    guidance_scale=3.0)
    params = VisualGenParams(num_frames=FRAMES, height=HEIGHT, width=WIDTH,
                             num_inference_steps=STEPS, guidance_scale=3.0, seed=3,
                             output_type="latent")
    out = gen.generate("the fox turns", params, image=image)
    assert _relative(out.latents, ref_latents) <= 1e-4


def test_same_seed_same_video_and_batches(gen):
    params = VisualGenParams(num_frames=5, height=32, width=32, num_inference_steps=2,
                             guidance_scale=2.0, seed=11, num_images_per_prompt=2)
    first = gen.generate(["a cube", "a fox"], params)
    again = gen.generate("a fox", VisualGenParams(num_frames=5, height=32, width=32,
                                                   num_inference_steps=2, guidance_scale=2.0,
                                                   seed=13))
    assert first.seeds == [11, 12, 13, 14] and len(first.videos) == 4
    assert np.array_equal(first.videos[2], again.videos[0])
    assert not np.array_equal(first.videos[0], first.videos[1])


@pytest.mark.parametrize("field,value,match", [
    ("num_frames", 8, "4 \\* k \\+ 1"), ("height", 40, "multiple of 16"),
    ("layers", 2, "layered")])
def test_bad_video_params(gen, field, value, match):
    with pytest.raises(ValueError, match=match):
        gen.generate("a fox", VisualGenParams(**{field: value}))
