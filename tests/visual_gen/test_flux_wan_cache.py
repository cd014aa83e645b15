"""Step caching and FP8 on the tiny FLUX.1-dev and Wan 2.2 (A14B's two experts, "moe", and the
dense TI2V-5B design), fp32 CPU: threshold 0 gives bitwise the uncached latents (both modes);
a positive threshold skips steps and stays within a stated PSNR of the uncached image/frames;
the cache starts over at Wan's expert switch; under quantization="fp8" every linear layer of
the blocks (FLUX's single-stream blocks and Wan's second expert included) is FP8, within a
stated PSNR. The PSNRs are of these tiny random models; real models differ."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.visual_gen.tiny_flux import save_tiny_flux
from tests.visual_gen.tiny_wan import save_tiny_wan
from tllm.kernels.fp8 import FP8_DTYPE
from tllm.visual_gen.fp8 import Fp8Linear
from tllm.visual_gen.models.wan import transformer as wan_transformer
from tllm.visual_gen.params import VisualGenParams

PROMPT = "a red fox runs in the snow"
PARAMS = {"flux": dict(height=32, width=48, num_inference_steps=8, seed=3),
          "wan-moe": dict(num_frames=5, height=32, width=32, num_inference_steps=8, seed=3,
                          guidance_scale=4.0, negative_prompt="blurry"),
          "wan-dense": dict(num_frames=5, height=32, width=32, num_inference_steps=8, seed=3,
                            guidance_scale=4.0, negative_prompt="blurry")}
# (model, mode, threshold, steps skipped at least, PSNR in dB at least), of the 8 steps;
# measured: FLUX 3 / 51.0 dB and 3 / 51.7 dB, Wan A14B 4 / 83.0 dB and 2 / 84.0 dB, Wan
# dense 4 / 55.9 dB and 4 / 57.8 dB (FLUX's TeaCache polynomial is >= 0.26 per step: its
# thresholds are TeaCache's FLUX ones, 0.25-0.8)
SKIPPING = [("flux", "teacache", 0.4, 2, 45.0), ("flux", "first_block", 0.8, 2, 45.0),
            ("wan-moe", "teacache", 0.2, 3, 75.0), ("wan-moe", "first_block", 0.1, 2, 75.0),
            ("wan-dense", "teacache", 0.2, 3, 50.0), ("wan-dense", "first_block", 0.2, 3, 50.0)]
# FP8 against the unquantized model: PSNR (dB) at least; measured: FLUX 55.3, Wan A14B 81.5
FP8_PSNR = {"flux": 50.0, "wan-moe": 75.0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {"flux": save_tiny_flux(tmp_path_factory.mktemp("tiny_flux_cache")),
            "wan-moe": save_tiny_wan(tmp_path_factory.mktemp("tiny_wan_moe_cache"), "moe"),
            "wan-dense": save_tiny_wan(tmp_path_factory.mktemp("tiny_wan_dense_cache"),
                                       "dense")}


@pytest.fixture(scope="module")
def gens(folders):
    from tllm.visual_gen import VisualGen
    return {name: VisualGen(str(path), device="cpu", show_progress=False)
            for name, path in folders.items()}


def _generate(gen, model: str, **kwargs):
    return gen.generate(PROMPT, VisualGenParams(**PARAMS[model], return_latents=True,
                                                **kwargs))


def _pixels(out) -> np.ndarray:
    return (out.videos[0] if out.videos else np.asarray(out.images[0])).astype(np.float64)


def _psnr(actual: np.ndarray, expected: np.ndarray) -> float:
    mse = ((actual - expected) ** 2).mean()
    return float("inf") if mse == 0 else float(10 * np.log10(255 ** 2 / mse))


@pytest.fixture(scope="module")
def uncached(gens):
    return {model: _generate(gen, model) for model, gen in gens.items()}


@pytest.mark.parametrize("mode", ["teacache", "first_block"])
@pytest.mark.parametrize("model", ["flux", "wan-moe", "wan-dense"])
def test_threshold_zero_equals_no_cache(gens, uncached, model, mode):
    out = _generate(gens[model], model, cache=mode, cache_threshold=0.0)
    assert out.steps_skipped == [0]
    assert torch.equal(out.latents, uncached[model].latents)


@pytest.mark.parametrize("model,mode,threshold,skipped,psnr", SKIPPING,
                         ids=[f"{m}-{c}" for m, c, *_ in SKIPPING])
def test_positive_threshold_skips_steps(gens, uncached, model, mode, threshold, skipped,
                                        psnr):
    out = _generate(gens[model], model, cache=mode, cache_threshold=threshold)
    got = _psnr(_pixels(out), _pixels(uncached[model]))
    print(f"{model} {mode} {threshold}: skipped {out.steps_skipped}, PSNR {got:.1f} dB")
    assert out.steps_skipped[0] >= skipped
    assert got >= psnr


@pytest.mark.parametrize("mode", ["teacache", "first_block"])
def test_cache_starts_over_at_the_expert_switch(gens, mode):
    """With a threshold nothing reaches, every step skips but the first, the last and the
    low-noise expert's first: the high-noise expert's residual is not reused."""
    from tllm.visual_gen.unipc import UniPCScheduler
    pipeline = gens["wan-moe"].pipeline
    scheduler = UniPCScheduler(pipeline.scheduler_config)
    scheduler.set_timesteps(8)
    experts = [pipeline.expert(t) for t in scheduler.timesteps]
    assert 0 < experts.index(pipeline.transformer_2) < 7      # the switch is mid-loop
    out = _generate(gens["wan-moe"], "wan-moe", cache=mode, cache_threshold=1e9)
    assert out.steps_skipped == [8 - 3]


def test_wan_uses_teacache_published_fits():
    """The A14B experts (Wan 2.1 14B's shape) take TeaCache's Wan 2.1 T2V 14B polynomial;
    TI2V-5B has none."""
    from tllm.visual_gen.models.wan.transformer import WAN22_T2V_A14B, WAN22_TI2V_5B
    coefficients = wan_transformer.TEACACHE_COEFFICIENTS
    assert coefficients[WAN22_T2V_A14B.inner_dim][-1] == -13.02252404
    assert WAN22_TI2V_5B.inner_dim not in coefficients


def test_wan_timestep_embedding_signal(gens, uncached, monkeypatch):
    """Where a published polynomial exists, the signal is the timestep embedding (as
    TeaCache fitted it): here an identity polynomial on the tiny model's width, whose
    embedding moves by 0.5-1 (relative) a step; measured: 3 skipped, 55.2 dB."""
    gen = gens["wan-dense"]
    width = gen.pipeline.transformer.config.inner_dim
    monkeypatch.setitem(wan_transformer.TEACACHE_COEFFICIENTS, width, (1.0, 0.0))
    out = _generate(gen, "wan-dense", cache="teacache", cache_threshold=1.0)
    got = _psnr(_pixels(out), _pixels(uncached["wan-dense"]))
    print(f"wan-dense timestep-embedding signal: skipped {out.steps_skipped}, "
          f"PSNR {got:.1f} dB")
    assert out.steps_skipped[0] >= 2 and got >= 50.0


@pytest.mark.parametrize("model", ["flux", "wan-moe"])
def test_fp8_weights_and_output(folders, uncached, model):
    from tllm.visual_gen import VisualGen
    fp8 = VisualGen(str(folders[model]), device="cpu", show_progress=False,
                    quantization="fp8")
    pipeline = fp8.pipeline
    transformers = [pipeline.transformer, getattr(pipeline, "transformer_2", None)]
    for transformer in filter(None, transformers):
        blocks = [*transformer.blocks, *getattr(transformer, "single_blocks", [])]
        linears = [m for block in blocks for name, m in block.named_modules()
                   if isinstance(m, (torch.nn.Linear, Fp8Linear)) and name != "mod"]
        assert linears and all(isinstance(m, Fp8Linear) and m.weight.dtype == FP8_DTYPE
                               for m in linears)
    got = _psnr(_pixels(_generate(fp8, model)), _pixels(uncached[model]))
    print(f"{model}: FP8 PSNR {got:.1f} dB")
    assert got >= FP8_PSNR[model]
