"""LTX-2 on CUDA in bfloat16 (skipped without a GPU): our pipeline (Triton kernels, cuDNN
attention, batched branches) against diffusers' LTX2Pipeline on the same tiny weights: the
norm-relative error of the final latents within bf16 drift, finite frames and sound."""
from __future__ import annotations

import pytest
import torch

from tests.visual_gen.tiny_ltx2 import MAX_TEXT_TOKENS, save_tiny_ltx2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_ltx2(tmp_path_factory.mktemp("tiny_ltx2_gpu"))


def test_bf16_pipeline_close_to_diffusers(folder):
    from diffusers import LTX2Pipeline

    from tllm.visual_gen import VisualGen, VisualGenParams
    reference = LTX2Pipeline.from_pretrained(folder, torch_dtype=torch.bfloat16).to("cuda")
    reference.set_progress_bar_config(disable=True)
    seen = {}

    def keep(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    reference(prompt="a robot dancing", negative_prompt="blurry", height=64, width=64,
              num_frames=9, frame_rate=25.0, num_inference_steps=3, stg_scale=0.0,
              audio_stg_scale=0.0, generator=torch.Generator().manual_seed(0),
              max_sequence_length=MAX_TEXT_TOKENS, output_type="latent",
              callback_on_step_end=keep)
    gen = VisualGen(str(folder), dtype="bfloat16", device="cuda", show_progress=False)
    out = gen.generate("a robot dancing", VisualGenParams(
        height=64, width=64, num_frames=9, frame_rate=25.0, num_inference_steps=3,
        negative_prompt="blurry", seed=0, return_latents=True))
    got, want = out.latents.float(), seen["latents"].float()
    assert ((got - want).norm() / want.norm()).item() < 3e-2
    assert out.videos[0].shape == (9, 64, 64, 3) and out.audio[0].shape[0] == 2
    assert torch.isfinite(out.audio[0]).all()
