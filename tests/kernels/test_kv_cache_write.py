"""KV-cache write (and its RoPE-fused form) vs the torch reference."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import relative_error  # noqa: E402
from tllm.kernels.fp8 import e4m3_spacing  # noqa: E402
from tllm.kernels.triton.kv_cache import (rope_and_write_kv, rope_and_write_kv_ref,  # noqa: E402
                                          write_kv, write_kv_ref)
from tllm.layers.rotary import RotaryEmbedding  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def caches(num_blocks, tokens_per_block, num_kv_heads, head_dim, dtype, device):
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


def random_slots(num_tokens, num_blocks, tokens_per_block, device, num_skipped=0):
    slots = torch.randperm(num_blocks * tokens_per_block)[:num_tokens]
    slots[:num_skipped] = -1  # padding tokens write nothing
    return slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim,tokens_per_block", [(2, 64, 16), (8, 128, 32),
                                                                    (3, 96, 16)])
def test_write_kv(device, dtype, num_kv_heads, head_dim, tokens_per_block):
    num_tokens = 13
    # k and v as strided slices of one fused projection output, as the model produces them
    fused = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, dtype=dtype, device=device)
    k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads:2 * num_kv_heads]
    slots = random_slots(num_tokens, 4, tokens_per_block, device, num_skipped=2)
    got = caches(4, tokens_per_block, num_kv_heads, head_dim, dtype, device)
    want = caches(4, tokens_per_block, num_kv_heads, head_dim, dtype, device)
    write_kv(k, v, *got, slots)
    write_kv_ref(k, v, *want, slots)
    for g, w in zip(got, want):  # a copy is exact, and untouched slots stay NaN
        assert torch.equal(g.isnan(), w.isnan())
        assert torch.equal(g.nan_to_num(), w.nan_to_num())


def test_write_kv_casts_to_cache_dtype(device):
    k, v = torch.randn(2, 5, 2, 64, device=device)
    slots = random_slots(5, 2, 16, device)
    got, want = caches(2, 16, 2, 64, torch.bfloat16, device), caches(2, 16, 2, 64,
                                                                     torch.bfloat16, device)
    write_kv(k, v, *got, slots)
    write_kv_ref(k, v, *want, slots)
    assert torch.equal(got[0].isnan(), want[0].isnan())
    if device.type == "cuda":  # the interpreter truncates fp32 -> bf16 instead of rounding
        assert torch.equal(got[0].nan_to_num(), want[0].nan_to_num())
    assert relative_error(got[0].nan_to_num(), want[0].nan_to_num()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 4, 128),
                                                             (6, 2, 96)])
def test_rope_and_write_kv(device, dtype, num_heads, num_kv_heads, head_dim):
    num_tokens, tokens_per_block, max_pos = 11, 16, 300
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rotary = RotaryEmbedding(inv_freq, 1.0, max_pos).to(device)
    positions = torch.randint(0, max_pos, (num_tokens,), device=device)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    slots = random_slots(num_tokens, 2, tokens_per_block, device, num_skipped=1)
    got = caches(2, tokens_per_block, num_kv_heads, head_dim, dtype, device)
    want = caches(2, tokens_per_block, num_kv_heads, head_dim, torch.float32, device)
    q_out = torch.full_like(q, float("nan"))
    rope_and_write_kv(positions, q, k, v, rotary.cos, rotary.sin, *got, slots, q_out=q_out)
    q_ref = rope_and_write_kv_ref(positions, q, k, v, rotary.cos, rotary.sin, *want, slots)
    assert relative_error(q_out, q_ref) < TOL[dtype]
    for g, w in zip(got, want):
        assert torch.equal(g.isnan(), w.isnan())
        assert relative_error(g.nan_to_num(), w.nan_to_num()) < TOL[dtype]
    # the model's own rotary module agrees too (it rounds cos/sin to the input dtype)
    q_mod, _ = rotary(positions, q, k)
    assert relative_error(q_out, q_mod.float()) < TOL[dtype]


FP8 = torch.float8_e4m3fn


def fp8_caches(num_blocks, tokens_per_block, num_kv_heads, head_dim, device):
    shape = (num_blocks, tokens_per_block, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), device=device).to(FP8),
            torch.full(shape, float("nan"), device=device).to(FP8))


def assert_same_bytes(got, want):
    """Byte for byte under the interpreter. On CUDA the reference's x / scale (a Python
    float) is torch's multiply by the reciprocal, one rounding more than the kernel's IEEE
    division: a value may land one e4m3 step away."""
    assert got.dtype == want.dtype == FP8
    if not got.is_cuda:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan())
    g, w = g.nan_to_num(), w.nan_to_num()
    diff = (g - w).abs()
    assert (diff <= e4m3_spacing(torch.maximum(g.abs(), w.abs()))).all()
    assert (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.011, 0.023)])
def test_write_kv_fp8(device, dtype, kv_scales):
    # x / scale rounded to nearest even and saturated, as the torch backend's write does;
    # 0.011 puts the largest values of randn * 3 past 448: they saturate
    num_tokens, num_kv_heads, head_dim = 13, 2, 64
    fused = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, device=device).mul(3).to(dtype)
    k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads:]
    slots = random_slots(num_tokens, 3, 16, device, num_skipped=2)
    got, want = fp8_caches(3, 16, num_kv_heads, head_dim, device), fp8_caches(
        3, 16, num_kv_heads, head_dim, device)
    write_kv(k, v, *got, slots, *kv_scales)
    write_kv_ref(k, v, *want, slots, *kv_scales)
    for g, w in zip(got, want):  # untouched slots keep their NaN bytes
        assert_same_bytes(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_write_kv_fp8(device, dtype):
    num_tokens, num_heads, num_kv_heads, head_dim, max_pos = 11, 8, 2, 64, 300
    kv_scales = (0.02, 0.005)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rotary = RotaryEmbedding(inv_freq, 1.0, max_pos).to(device)
    positions = torch.randint(0, max_pos, (num_tokens,), device=device)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    slots = random_slots(num_tokens, 2, 16, device, num_skipped=1)
    got = fp8_caches(2, 16, num_kv_heads, head_dim, device)
    want = fp8_caches(2, 16, num_kv_heads, head_dim, device)
    q_out = rope_and_write_kv(positions, q, k, v, rotary.cos, rotary.sin, *got, slots,
                              k_scale=kv_scales[0], v_scale=kv_scales[1])
    q_ref = rope_and_write_kv_ref(positions, q, k, v, rotary.cos, rotary.sin, *want, slots,
                                  *kv_scales)
    assert relative_error(q_out, q_ref) < TOL[dtype]  # q is never quantized
    assert_same_bytes(got[1], want[1])                # v is a plain quantized copy
    # the rotated k is rounded in a different order on the GPU (fused multiply-adds), which
    # may move a value across an fp8 rounding boundary
    assert torch.equal(got[0].float().isnan(), want[0].float().isnan())
    err = relative_error(got[0].float().nan_to_num(), want[0].float().nan_to_num())
    assert err < 1e-2, err


def test_write_kv_rejects_mixed_cache_dtypes(device):
    k = torch.randn(2, 1, 16, device=device)
    slots = random_slots(2, 1, 16, device)
    k_cache = torch.zeros(1, 16, 1, 16, device=device)
    with pytest.raises(ValueError, match="fp8"):
        write_kv(k, k, k_cache, k_cache.to(FP8), slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [1, 2], ids=["rmsnorm", "gemma"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (3, 3, 96)])
def test_rope_and_write_kv_with_qk_norm(device, dtype, kind, num_heads, num_kv_heads,
                                        head_dim):
    """Per-head RMSNorms of q and k in the same kernel (Qwen3's, Gemma 3's) against the
    modules themselves, then the rotation; head_dim 96: padded halves; q and k weights
    differ (equal head counts must not mix them up)."""
    from tllm.kernels.triton.kv_cache import QkNorm
    from tllm.layers.norm import GemmaRMSNorm, RMSNorm
    num_tokens, tokens_per_block, max_pos = 9, 16, 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rotary = RotaryEmbedding(inv_freq, 1.0, max_pos).to(device)
    positions = torch.randint(0, max_pos, (num_tokens,), device=device)
    q = 3 * torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    norm_cls = RMSNorm if kind == 1 else GemmaRMSNorm
    norms = [norm_cls(head_dim, 1e-6).to(device).to(dtype) for _ in range(2)]
    for norm in norms:
        norm.weight.data = (1 + 0.5 * torch.randn(head_dim, device=device)).to(dtype)
    slots = random_slots(num_tokens, 2, tokens_per_block, device, num_skipped=1)
    got = caches(2, tokens_per_block, num_kv_heads, head_dim, dtype, device)
    fused = QkNorm(norms[0].weight, norms[1].weight, 1e-6, kind)
    q_out = rope_and_write_kv(positions, q, k, v, rotary.cos, rotary.sin, *got, slots,
                              qk_norm=fused)
    on_cpu = [norm_cls(head_dim, 1e-6).to(dtype) for _ in range(2)]
    for mine, theirs in zip(on_cpu, norms):
        mine.weight.data = theirs.weight.data.cpu()
    args = (positions.cpu(), q.cpu(), k.cpu(), v.cpu(), rotary.cos.cpu(), rotary.sin.cpu())
    # the modules, then the unfused reference
    want = caches(2, tokens_per_block, num_kv_heads, head_dim, torch.float32, "cpu")
    q_ref = rope_and_write_kv_ref(args[0], on_cpu[0](args[1]), on_cpu[1](args[2]), *args[3:],
                                  *want, slots.cpu())
    assert relative_error(q_out.cpu(), q_ref) < TOL[dtype]
    for g, w in zip(got, want):
        assert torch.equal(g.cpu().isnan(), w.isnan())
        assert relative_error(g.cpu().nan_to_num(), w.nan_to_num()) < TOL[dtype]
    # the reference's own form of the norms is the modules'
    cpu_norm = QkNorm(on_cpu[0].weight, on_cpu[1].weight, 1e-6, kind)
    again = caches(2, tokens_per_block, num_kv_heads, head_dim, torch.float32, "cpu")
    q_again = rope_and_write_kv_ref(*args, *again, slots.cpu(), qk_norm=cpu_norm)
    assert torch.equal(q_again, q_ref)
    assert torch.equal(again[0].nan_to_num(), want[0].nan_to_num())
