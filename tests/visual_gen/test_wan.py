"""Our Wan pipeline against diffusers' WanPipeline on the same tiny random weights, in Wan
2.2's two designs: A14B's two experts switched by timestep ("moe") and TI2V-5B's dense
transformer with its 16x VAE ("dense"). Final latents after 3 steps (<= 1e-4 relative) with
guidance on and off, square and not; decoded frames; the transformer alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.visual_gen.conftest import max_relative_error
from tests.visual_gen.tiny_wan import diffusers_wan, save_tiny_wan, tiny_transformer
from tllm.visual_gen import VisualGen, VisualGenParams
from tllm.visual_gen.models.wan.transformer import WanConfig, WanTransformer

PROMPT = "a red fox runs in the snow"
FRAMES, STEPS = 5, 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind ("moe" or "dense") -> (ours, diffusers'), each built once."""
    built = {}

    def get(kind: str):
        if kind not in built:
            path = save_tiny_wan(tmp_path_factory.mktemp(f"tiny_wan_{kind}"), kind)
            built[kind] = (VisualGen(str(path), device="cpu", show_progress=False),
                           diffusers_wan(path))
        return built[kind]
    return get


def _reference(pipe, seed: int, **kwargs):
    seen = {}

    def keep_latents(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    frames = pipe(PROMPT, num_frames=FRAMES, num_inference_steps=STEPS, output_type="np",
                  generator=torch.Generator().manual_seed(seed),
                  callback_on_step_end=keep_latents, **kwargs).frames
    return seen["latents"], frames[0]


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("kind,height,width", [
    ("moe", 32, 32), ("moe", 32, 48), ("dense", 32, 32), ("dense", 32, 64)])
def test_pipeline_equals_diffusers(models, kind, height, width, guidance):
    gen, reference = models(kind)
    negative = "blurry" if guidance > 1 else None
    ref_latents, ref_frames = _reference(reference, 7, height=height, width=width,
                                         guidance_scale=guidance, negative_prompt=negative)
    out = gen.generate(PROMPT, VisualGenParams(
        num_frames=FRAMES, height=height, width=width, num_inference_steps=STEPS, seed=7,
        guidance_scale=guidance, negative_prompt=negative, return_latents=True))
    assert max_relative_error(out.latents, ref_latents) <= 1e-4
    frames = gen.pipeline.decode(out.latents).numpy()
    assert frames.shape == ref_frames.shape == (FRAMES, height, width, 3)
    assert np.abs(frames - ref_frames).max() <= 1e-3
    assert out.videos[0].dtype == np.uint8 and out.videos[0].shape == frames.shape


def test_experts_switch_at_the_boundary(models):
    gen, _ = models("moe")
    pipeline = gen.pipeline
    assert pipeline.expert(torch.tensor(999)) is pipeline.transformer
    assert pipeline.expert(torch.tensor(875)) is pipeline.transformer
    assert pipeline.expert(torch.tensor(874)) is pipeline.transformer_2


def test_model_rules(models):
    gen, _ = models("dense")
    with pytest.raises(ValueError, match=r"VisualGenParams\.height"):
        gen.generate(PROMPT, VisualGenParams(num_frames=FRAMES, height=48, width=32))
    with pytest.raises(ValueError, match=r"VisualGenParams\.num_frames"):
        gen.generate(PROMPT, VisualGenParams(num_frames=6, height=32, width=32))


@pytest.mark.parametrize("cross_attn_norm", [True, False])
def test_transformer_equals_diffusers(cross_attn_norm):
    torch.manual_seed(0)
    theirs = tiny_transformer(4, cross_attn_norm=cross_attn_norm)
    ours = WanTransformer(WanConfig.from_dict(theirs.config))
    ours.load_diffusers_state_dict(theirs.state_dict())
    hidden, context = torch.randn(2, 4, 3, 6, 10), torch.randn(2, 9, 32)
    timestep = torch.tensor([900, 300])
    want = theirs(hidden_states=hidden, timestep=timestep, encoder_hidden_states=context,
                  return_dict=False)[0]
    assert max_relative_error(ours(hidden, timestep, context), want) <= 1e-5
    state = theirs.state_dict()
    views = ours.diffusers_state_dict(list(state))
    assert all(torch.equal(views[name], tensor) for name, tensor in state.items())


def test_dummy_presets_have_the_real_shapes():
    from tllm.visual_gen import registry
    from tllm.visual_gen.models.wan.transformer import WAN22_T2V_A14B, WAN22_TI2V_5B
    spec = registry.resolve("dummy:wan2.2-ti2v-5b")
    assert spec.pipeline_class().__name__ == "WanPipeline"
    with torch.device("meta"):
        assert 4.9e9 < sum(p.numel() for p in WanTransformer(WAN22_TI2V_5B).parameters()) < 5.1e9
        assert 14e9 < sum(p.numel() for p in WanTransformer(WAN22_T2V_A14B).parameters()) < 14.5e9
    # the 5B with UMT5-XXL and the VAE; A14B's two experts
    assert 11e9 < spec.pipeline_class().dummy_parameter_count("wan2.2-ti2v-5b") < 12e9
    assert 34e9 < spec.pipeline_class().dummy_parameter_count("wan2.2-t2v-a14b") < 35e9
