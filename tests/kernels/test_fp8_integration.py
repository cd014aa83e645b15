"""FP8 through a model: the dispatch of tllm.kernels.fp8_ops, the pre-quantized hand-over
from RMSNorm / SiLU-and-mul to the FP8 linear layers (QuantizedActivation), and on the GPU
a tiny FP8 Llama on the fast paths against the same model on the emulation."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_tiny_model
from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.attention.testing import relative_error
from tllm.kernels import fp8 as ref
from tllm.kernels import fp8_ops
from tllm.layers.activation import SiluAndMul
from tllm.layers.norm import RMSNorm

CUDA = torch.cuda.is_available()
NUM_NEW = 16


def prompts(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()}
            for n in (5, 40, 77, 1)]


def generate(path, device: str, dtype: str, kv_dtype: str = "auto"):
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, logprobs=5)
    with LLM(str(path), quantization="fp8", dtype=dtype, device=device, max_batch_size=8,
             kv_cache_config=KvCacheConfig(dtype=kv_dtype, max_tokens=2048)) as llm:
        return [o.outputs[0] for o in llm.generate(prompts(384), params, use_tqdm=False)]


def test_dispatch_on_cpu_is_the_emulation():
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    assert fp8_ops.gemm_path(x, 256, 128) == "emulation"
    assert fp8_ops.gemm_path(x, 256, 128, (128, 128)) == "emulation"
    assert not fp8_ops.takes_quantized_input(x, 256, 128)


def test_norm_and_activation_quantize_on_cpu():
    x, residual = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    norm = RMSNorm(64)
    norm.weight.data = torch.randn(64)
    (q, new_residual), (plain, plain_residual) = (
        norm(x, residual, quantize_to=ref.FP8_DTYPE), norm(x, residual))
    want = ref.quantize_activation(plain)
    assert torch.equal(q.q.view(torch.uint8), want.q.view(torch.uint8))
    assert torch.equal(q.scale, want.scale) and torch.equal(new_residual, plain_residual)
    h = torch.randn(3, 2 * 48)
    got, want = SiluAndMul()(h, quantize_to=ref.FP8_DTYPE), ref.quantize_activation(
        SiluAndMul()(h))
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
    with pytest.raises(ValueError, match="quantizes to"):
        norm(x, quantize_to=torch.int8)


def test_prequantized_hand_over_changes_nothing(tmp_path, monkeypatch):
    """Forcing every FP8 linear to take its input quantized by the op before it gives the
    same tokens and logprobs, to the bit, as quantizing inside the linear (the CPU path)."""
    make_tiny_model("Llama", tmp_path)
    plain = generate(tmp_path, "cpu", "float32")
    calls = []
    real = fp8_ops.fp8_linear

    def spy(x, *args, **kwargs):
        calls.append(isinstance(x, ref.QuantizedActivation))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(fp8_ops, "takes_quantized_input", lambda x, n, k: True)
    monkeypatch.setattr(fp8_ops, "fp8_linear", spy)
    handed = generate(tmp_path, "cpu", "float32")
    # o_proj quantizes its own input; qkv, gate_up and down take theirs pre-quantized
    assert calls and sum(calls) == 3 * len(calls) // 4
    for a, b in zip(plain, handed):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert {t: v.logprob for t, v in x.items()} == {t: v.logprob for t, v in y.items()}


@pytest.mark.skipif(not CUDA, reason="the CUDA kernels run on the GPU only")
@pytest.mark.parametrize("m", [1, 7, 32, 33, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(256, 512), (200, 136)])  # the second: no _scaled_mm
def test_fp8_linear_paths_on_gpu(m, dtype, n, k):
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    wq, ws = ref.quantize_per_channel(torch.randn(n, k, device="cuda") * 0.05)
    path = fp8_ops.gemm_path(x, n, k)
    assert path == ("small_m" if m <= fp8_ops.SMALL_M else
                    "scaled_mm" if dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0
                    else "triton_mm")
    exact = x.float() @ (wq.float() * ws).t()
    got = fp8_ops.fp8_linear(x, wq, ws)
    assert got.dtype == dtype and got.shape == (m, n)
    if path == "small_m":
        assert relative_error(got, exact) < 1e-2              # weight-only: x unquantized
    else:
        xq, xs = ref.quantize_per_token(x)
        assert relative_error(got, ref.scaled_mm_ref(xq, xs, wq, ws, torch.float32)) < 1e-2
        prequantized = fp8_ops.fp8_linear(ref.QuantizedActivation(xq, xs, dtype), wq, ws)
        assert relative_error(prequantized, got.float()) < 1e-2
    input_scale = x.float().abs().amax().reshape(1) / 448
    static = fp8_ops.fp8_linear(x, wq, ws, input_scale)
    assert relative_error(static, exact) < 0.05                # one fp8 rounding of x


@pytest.mark.skipif(not CUDA, reason="the CUDA kernels run on the GPU only")
@pytest.mark.parametrize("m", [1, 32, 100])
def test_block_fp8_linear_on_gpu(m):
    n, k, block = 384, 512, (128, 128)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = ref.quantize_blocks(torch.randn(n, k, device="cuda") * 0.05, block)
    got = fp8_ops.block_fp8_linear(x, wq, ws, block)
    if m <= fp8_ops.SMALL_M:
        want = ref.w8a16_mm_ref(x.float(), wq, ws, block)
    else:
        xq, xs = ref.quantize_per_token_group(x, block[1])
        want = ref.block_scaled_mm_ref(xq, xs, wq, ws, block, torch.float32)
    assert relative_error(got, want) < 1e-2


@pytest.mark.skipif(not CUDA, reason="the CUDA kernels run on the GPU only")
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_fp8_model_on_gpu_fast_paths(tmp_path, monkeypatch, kv_dtype):
    """A tiny FP8 Llama on CUDA runs the W8A16 kernel at decode, the fused norm/activation
    quantization and _scaled_mm at prefill; its greedy tokens follow the emulated run of the
    same weights (where they part, each side's token is in the other's top-5)."""
    from tllm.kernels.triton import activation, fp8_gemm, rmsnorm
    make_tiny_model("Llama", tmp_path)
    counts = {"w8a16": 0, "rms_norm_quant": 0, "silu_and_mul_quant": 0, "scaled_mm": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fp8_gemm, "w8a16_mm", counted("w8a16", fp8_gemm.w8a16_mm))
    monkeypatch.setattr(rmsnorm, "rms_norm_quant",
                        counted("rms_norm_quant", rmsnorm.rms_norm_quant))
    monkeypatch.setattr(activation, "silu_and_mul_quant",
                        counted("silu_and_mul_quant", activation.silu_and_mul_quant))
    monkeypatch.setattr(torch, "_scaled_mm", counted("scaled_mm", torch._scaled_mm))
    fast = generate(tmp_path, "cuda", "bfloat16", kv_dtype)
    assert all(counts.values()), counts
    monkeypatch.setattr(fp8_ops, "gemm_path", lambda *args, **kwargs: "emulation")
    emulated = generate(tmp_path, "cuda", "bfloat16", kv_dtype)
    for a, b in zip(fast, emulated):
        step = next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t),
                    None)
        if step is not None:
            assert a.token_ids[step] in b.logprobs[step] and b.token_ids[step] in a.logprobs[step]
