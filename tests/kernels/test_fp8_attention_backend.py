"""The Triton attention backend with an fp8 KV cache against the torch backend on the same
step: the same cache bytes written, the same attention output."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention import get_attention_backend  # noqa: E402
from tllm.attention.testing import make_paged_batch, relative_error  # noqa: E402
from tllm.kernels.fp8 import e4m3_spacing  # noqa: E402
from tllm.kernels.paged import to_cache  # noqa: E402
from tllm.kernels.triton.attention_ref import paged_attention_ref  # noqa: E402
from tllm.kernels.triton.kv_cache import rope_and_write_kv_ref  # noqa: E402
from tllm.layers.rotary import RotaryEmbedding  # noqa: E402

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
KV_SCALES = (0.017, 0.029)


def assert_same_cache(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Byte for byte under the interpreter. On CUDA torch's x / scale (a Python float) is a
    multiply by the reciprocal, one rounding more than the kernel's IEEE division: a value
    may land one e4m3 step away."""
    if not ours.is_cuda:
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
        return
    a, b = ours.float(), theirs.float()
    diff = (a - b).abs()
    assert (diff <= e4m3_spacing(torch.maximum(a.abs(), b.abs()))).all()
    assert (diff > 0).float().mean() < 0.01


def run_both(device, query_lens, prefix_lens, dtype, num_heads=8, num_kv_heads=2, head_dim=64):
    batch = make_paged_batch(query_lens, prefix_lens, num_heads, num_kv_heads, head_dim, 16,
                             dtype, device)
    fp8 = torch.empty(0, dtype=FP8)
    cache = tuple(to_cache(c, fp8, s) for c, s in zip(batch.kv_cache, KV_SCALES))
    outs, caches = {}, {}
    for name in ("torch", "triton"):
        backend = get_attention_backend(name)(num_heads, num_kv_heads, head_dim,
                                              head_dim ** -0.5)
        caches[name] = tuple(c.clone() for c in cache)
        outs[name] = backend.forward(batch.q, batch.k, batch.v, caches[name], batch.metadata,
                                     KV_SCALES)
    return outs, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens,prefix_lens", [([40, 24, 1, 1], [0, 37, 90, 5]),
                                                    ([1, 1, 1], [300, 0, 64])])
def test_fp8_cache_matches_torch_backend(device, dtype, query_lens, prefix_lens):
    outs, caches = run_both(device, query_lens, prefix_lens, dtype)
    assert outs["triton"].dtype == dtype
    assert relative_error(outs["triton"], outs["torch"].float()) < TOL[dtype]
    for ours, theirs in zip(caches["triton"], caches["torch"]):
        assert ours.dtype == FP8  # the same quantization of this step's k and v
        assert_same_cache(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_with_fused_rope(device, dtype):
    # against the float32 references of the fused write and of attention (the torch backend
    # rounds the rotated keys to the dtype before quantizing, a different fp8 rounding)
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    batch = make_paged_batch([20, 1, 3], [0, 50, 7], num_heads, num_kv_heads, head_dim, 16,
                             dtype, device)
    m = batch.metadata
    fp8 = torch.empty(0, dtype=FP8)
    cache = tuple(to_cache(c, fp8, s) for c, s in zip(batch.kv_cache, KV_SCALES))
    want_cache = tuple(c.clone() for c in cache)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rotary = RotaryEmbedding(inv_freq, 1.0, 512).to(device)
    backend = get_attention_backend("triton")(num_heads, num_kv_heads, head_dim,
                                              head_dim ** -0.5)
    out = backend.forward_with_rope(batch.q, batch.k, batch.v, cache, m, rotary, KV_SCALES)
    q_ref = rope_and_write_kv_ref(m.positions, batch.q, batch.k, batch.v, rotary.cos,
                                  rotary.sin, *want_cache, m.slot_mapping, *KV_SCALES)
    want = paged_attention_ref(q_ref, *want_cache, m.block_tables, m.query_start_loc,
                               m.seq_lens, head_dim ** -0.5, kv_scales=KV_SCALES)
    assert relative_error(out, want) < TOL[dtype]
    for ours, theirs in zip(cache, want_cache):
        assert relative_error(ours.float(), theirs.float()) < 1e-2
