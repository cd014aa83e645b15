"""Step caching (step_cache.py) on the tiny Qwen-Image, LTX-2 and Cosmos 3: threshold 0 gives
bitwise the uncached output (both modes); a positive threshold skips steps, says so in
`steps_skipped`, and stays within a stated PSNR of the uncached image/frames (measured on
these tiny random models, fp32 CPU; real models differ); bad parameters are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tests.visual_gen.tiny_ltx2 import save_tiny_ltx2
from tllm.visual_gen.params import VisualGenParams
from tllm.visual_gen.step_cache import BlockStack, StepCache, check_supported, run_blocks

IMAGE = dict(height=64, width=64, num_inference_steps=8, seed=3, negative_prompt="blurry")
VIDEO = dict(num_frames=9, height=32, width=32, num_inference_steps=8, seed=3,
             guidance_scale=3.0, negative_prompt="blurry")
# (model, mode, threshold, steps skipped at least, PSNR in dB at least) of the 8 steps;
# measured: Qwen-Image 4 / 58.2 dB and 3 / 64.4 dB, LTX-2 3 / 39.1 dB and 3 / 42.1 dB,
# Cosmos 3 3 / 66.6 dB and 4 / 59.9 dB
SKIPPING = [("qwen", "teacache", 0.2, 3, 50.0), ("qwen", "first_block", 0.4, 2, 55.0),
            ("ltx2", "teacache", 0.2, 2, 35.0), ("ltx2", "first_block", 0.1, 2, 38.0),
            ("cosmos", "teacache", 0.1, 2, 60.0), ("cosmos", "first_block", 0.1, 3, 55.0)]


@pytest.fixture(scope="module")
def ltx2_gen(tmp_path_factory):
    from tllm.visual_gen import VisualGen
    path = save_tiny_ltx2(tmp_path_factory.mktemp("tiny_ltx2_cache"))
    return VisualGen(str(path), device="cpu", show_progress=False)


@pytest.fixture(scope="module")
def models(visual_gen, ltx2_gen, cosmos_gen):
    return {"qwen": (visual_gen, IMAGE), "ltx2": (ltx2_gen, VIDEO),
            "cosmos": (cosmos_gen, dict(VIDEO, num_frames=5))}


def _pixels(out) -> np.ndarray:
    return out.videos[0] if out.videos else np.asarray(out.images[0])


def _psnr(actual: np.ndarray, expected: np.ndarray) -> float:
    mse = ((actual.astype(np.float64) - expected.astype(np.float64)) ** 2).mean()
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


@pytest.fixture(scope="module")
def uncached(models):
    return {name: _pixels(gen.generate("a red fox", VisualGenParams(**base)))
            for name, (gen, base) in models.items()}


@pytest.mark.parametrize("mode", ["teacache", "first_block"])
@pytest.mark.parametrize("model", ["qwen", "ltx2", "cosmos"])
def test_threshold_zero_equals_no_cache(models, uncached, model, mode):
    gen, base = models[model]
    out = gen.generate("a red fox", VisualGenParams(cache=mode, cache_threshold=0.0, **base))
    assert out.steps_skipped == [0]
    assert np.array_equal(_pixels(out), uncached[model])


@pytest.mark.parametrize("model,mode,threshold,skipped,psnr", SKIPPING,
                         ids=[f"{m}-{c}" for m, c, *_ in SKIPPING])
def test_positive_threshold_skips_steps(models, uncached, model, mode, threshold, skipped,
                                        psnr):
    gen, base = models[model]
    out = gen.generate("a red fox", VisualGenParams(cache=mode, cache_threshold=threshold,
                                                    **base))
    got = _psnr(_pixels(out), uncached[model])
    print(f"{model} {mode} {threshold}: skipped {out.steps_skipped}, PSNR {got:.1f} dB")
    assert out.steps_skipped[0] >= skipped
    assert got >= psnr


def test_cache_decisions():
    """A constant signal skips every step but the first and the last; the skipped steps
    add the residual the last full step added."""
    calls = []
    stack = BlockStack(first=lambda x: calls.append("first") or x + 1,
                       rest=lambda x: calls.append("rest") or x * 2,
                       modulated_input=lambda x: torch.ones(3), hidden=lambda x: [x],
                       with_residuals=lambda x, r: x + r[0])
    cache = StepCache("teacache", 0.5)
    outputs = []
    for index in range(4):
        cache.step_index, cache.num_steps = index, 4
        outputs.append(run_blocks(stack, torch.full((3,), float(index)), cache))
    assert cache.skipped == 2 and calls.count("first") == 2
    assert [o[0].item() for o in outputs] == [2.0, 3.0, 4.0, 8.0]   # (0 + 1) * 2 = 0 + 2
    cache.free()
    assert cache.skipped_per_loop == [2] and cache.residuals is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache="deepcache"), "cache must be"), (dict(cache_threshold=0.1), "needs a cache"),
    (dict(cache="teacache", cache_threshold=-1.0), ">= 0")])
def test_bad_cache_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VisualGenParams(**kwargs)


def test_reference_transformer_is_refused():
    with pytest.raises(ValueError, match="transformer_impl"):
        check_supported(nn.Linear(2, 2), "teacache")
    check_supported(nn.Linear(2, 2), None)
