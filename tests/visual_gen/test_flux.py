"""Our FLUX.1 pipeline against diffusers' FluxPipeline on the same tiny random weights (dev
with its guidance embedding, and schnell without): final latents after 3 steps (<= 1e-4
relative), with true CFG off and on, square and not; the decoded images; and the
transformer alone, whose weights map back to diffusers' names."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.visual_gen.conftest import max_relative_error
from tests.visual_gen.tiny_flux import diffusers_flux, save_tiny_flux, tiny_transformer
from tllm.visual_gen import VisualGen, VisualGenParams
from tllm.visual_gen.models.flux.transformer import FluxConfig, FluxTransformer

PROMPT = "a red fox in the snow"
STEPS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """variant ("dev" or "schnell") -> (ours, diffusers'), each built once."""
    built = {}

    def get(variant: str):
        if variant not in built:
            path = save_tiny_flux(tmp_path_factory.mktemp(f"tiny_flux_{variant}"),
                                  dev=variant == "dev")
            built[variant] = (VisualGen(str(path), device="cpu", show_progress=False),
                              diffusers_flux(path))
        return built[variant]
    return get


@pytest.fixture(scope="module")
def flux(models):
    return models("dev")


def _reference(pipe, seed: int, **kwargs):
    seen = {}

    def keep_latents(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    images = pipe(PROMPT, generator=torch.Generator().manual_seed(seed), output_type="np",
                  callback_on_step_end=keep_latents, num_inference_steps=STEPS, **kwargs).images
    return seen["latents"], images


@pytest.mark.parametrize("variant,height,width,negative_prompt", [
    ("dev", 32, 32, None), ("dev", 32, 48, None), ("dev", 32, 32, "blurry"),
    ("dev", 48, 32, "blurry"), ("schnell", 32, 32, None), ("schnell", 32, 48, "blurry")])
def test_pipeline_equals_diffusers(models, variant, height, width, negative_prompt):
    gen, reference = models(variant)
    ref_latents, ref_images = _reference(reference, 5, height=height, width=width,
                                         negative_prompt=negative_prompt, true_cfg_scale=3.0,
                                         guidance_scale=4.0)
    out = gen.generate(PROMPT, VisualGenParams(
        height=height, width=width, num_inference_steps=STEPS, seed=5, guidance_scale=4.0,
        negative_prompt=negative_prompt, true_cfg_scale=3.0, return_latents=True))
    assert max_relative_error(out.latents, ref_latents) <= 1e-4
    images = gen.pipeline.decode(out.latents, height, width).permute(0, 2, 3, 1).numpy()
    assert np.abs(images - ref_images).max() <= 1e-3
    assert out.images[0].size == (width, height)


def test_batch_equals_separate_runs(flux):
    gen, _ = flux
    common = dict(height=16, width=32, num_inference_steps=2, output_type="latent")
    batch = gen.generate(["a cat", PROMPT], VisualGenParams(seed=3, **common))
    alone = gen.generate(PROMPT, VisualGenParams(seed=4, **common))
    assert batch.seeds == [3, 4] and batch.images == []
    assert max_relative_error(batch.latents[1:], alone.latents) <= 1e-5


def test_model_rules(flux):
    gen, _ = flux
    with pytest.raises(ValueError, match=r"VisualGenParams\.height"):
        gen.generate(PROMPT, VisualGenParams(height=18))
    with pytest.raises(ValueError, match=r"VisualGenParams\.num_frames"):
        gen.generate(PROMPT, VisualGenParams(num_frames=9))


@pytest.mark.parametrize("guidance_embeds", [True, False])
def test_transformer_equals_diffusers(guidance_embeds):
    torch.manual_seed(0)
    theirs = tiny_transformer(guidance_embeds)
    ours = FluxTransformer(FluxConfig.from_dict(theirs.config))
    ours.load_diffusers_state_dict(theirs.state_dict())
    rows, cols, text = 3, 5, 7
    hidden, context = torch.randn(2, rows * cols, 16), torch.randn(2, text, 32)
    pooled, timestep = torch.randn(2, 32), torch.tensor([0.7, 0.2])
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(rows).float(),
                                         torch.arange(cols).float(), indexing="ij"), -1)
    img_ids, txt_ids = img_ids.reshape(-1, 3), torch.zeros(text, 3)
    guidance = torch.tensor([3.5, 2.0]) if guidance_embeds else None
    want = theirs(hidden_states=hidden, encoder_hidden_states=context,
                  pooled_projections=pooled, timestep=timestep, img_ids=img_ids,
                  txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]
    got = ours(hidden, context, pooled, timestep, img_ids, txt_ids, guidance)
    assert max_relative_error(got, want) <= 1e-5
    state = theirs.state_dict()
    views = ours.diffusers_state_dict(list(state))
    assert views.keys() == state.keys()
    assert all(torch.equal(views[name], tensor) for name, tensor in state.items())


def test_dummy_presets_have_the_real_shapes():
    from tllm.visual_gen import registry
    dev = registry.resolve("dummy:flux.1-dev")
    assert dev.pipeline_class().__name__ == "FluxPipeline"
    assert 16.5e9 < dev.pipeline_class().dummy_parameter_count("flux.1-dev") < 17.2e9
    with torch.device("meta"):      # 12B transformer, T5-XXL, CLIP-L, the VAE
        assert 11.8e9 < sum(p.numel() for p in FluxTransformer(FluxConfig()).parameters()) < 12e9
