"""FP8 linear layers for the DiT transformers (visual_gen/fp8.py) on the tiny Qwen-Image,
LTX-2 and Cosmos 3, fp32 CPU (the FP8 method's torch emulation): the blocks' linear weights
are stored in e4m3 with per-channel scales, the rest stays in the model's dtype, and the
output stays within a stated PSNR of the unquantized model's; bad arguments are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.visual_gen.tiny_ltx2 import save_tiny_ltx2
from tllm.kernels.fp8 import FP8_DTYPE
from tllm.visual_gen.fp8 import Fp8Linear
from tllm.visual_gen.params import VisualGenParams

IMAGE = dict(height=64, width=64, num_inference_steps=4, seed=5, negative_prompt="blurry")
VIDEO = dict(num_frames=9, height=32, width=32, num_inference_steps=4, seed=5,
             guidance_scale=3.0, negative_prompt="blurry")
# PSNR (dB) against the unquantized model, at least; measured: Qwen-Image 61.7, LTX-2 44.5,
# Cosmos 3 56.2
MIN_PSNR = {"qwen": 55.0, "ltx2": 40.0, "cosmos": 50.0}


@pytest.fixture(scope="module")
def folders(qwen_image_dir, cosmos_dir, tmp_path_factory):
    ltx2_dir = save_tiny_ltx2(tmp_path_factory.mktemp("tiny_ltx2_fp8"))
    return {"qwen": (qwen_image_dir, IMAGE), "ltx2": (ltx2_dir, VIDEO),
            "cosmos": (cosmos_dir, dict(VIDEO, num_frames=5))}


def _pixels(out) -> np.ndarray:
    return (out.videos[0] if out.videos else np.asarray(out.images[0])).astype(np.float64)


@pytest.mark.parametrize("model", ["qwen", "ltx2", "cosmos"])
def test_fp8_weights_and_output(folders, model):
    from tllm.visual_gen import VisualGen
    path, params = folders[model]
    plain = VisualGen(str(path), device="cpu", show_progress=False)
    fp8 = VisualGen(str(path), device="cpu", show_progress=False, quantization="fp8")
    layers = [m for m in fp8.pipeline.transformer.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.weight.dtype == FP8_DTYPE for m in layers)
    assert all(m.weight_scale.shape == (m.out_features, 1) for m in layers)
    kept = [m for m in fp8.pipeline.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert kept and all(m.weight.dtype == torch.float32 for m in kept)
    expected = _pixels(plain.generate("a red fox", VisualGenParams(**params)))
    got = _pixels(fp8.generate("a red fox", VisualGenParams(**params)))
    psnr = 10 * np.log10(255 ** 2 / ((got - expected) ** 2).mean())
    print(f"{model}: {len(layers)} FP8 layers, PSNR {psnr:.1f} dB")
    assert psnr >= MIN_PSNR[model]


@pytest.mark.parametrize("kwargs,match", [(dict(quantization="int4"), "quantization must"),
                                          (dict(quantization="fp8",
                                                transformer_impl="diffusers"), "our transformer")])
def test_bad_quantization(qwen_image_dir, kwargs, match):
    from tllm.visual_gen import VisualGen
    with pytest.raises(ValueError, match=match):
        VisualGen(str(qwen_image_dir), device="cpu", **kwargs)
