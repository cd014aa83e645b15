"""Paged context attention kernel vs the float32 torch reference."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import make_paged_batch, relative_error  # noqa: E402
from tllm.kernels.triton.context_attention import (paged_attention_ref,  # noqa: E402
                                                   paged_context_attention)
from tllm.kernels.paged import to_cache  # noqa: E402
from tllm.kernels.triton.kv_cache import write_kv_ref  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
CUDA = torch.cuda.is_available()


def fp8_caches(kv_cache, kv_scales):
    """With kv_scales, the random prefix caches stored as fp8 e4m3 (x / scale)."""
    if kv_scales is None:
        return kv_cache, (1.0, 1.0)
    fp8 = torch.empty(0, dtype=torch.float8_e4m3fn)
    return tuple(to_cache(c, fp8, s) for c, s in zip(kv_cache, kv_scales)), kv_scales


def check(device, query_lens, prefix_lens, num_heads=8, num_kv_heads=2, head_dim=64,
          tokens_per_block=16, dtype=torch.bfloat16, sliding_window=None, q=None,
          kv_scales=None, logits_soft_cap=None, chunk=None):
    batch = make_paged_batch(query_lens, prefix_lens, num_heads, num_kv_heads, head_dim,
                             tokens_per_block, dtype, device)
    m = batch.metadata
    caches, scales = fp8_caches(batch.kv_cache, kv_scales)
    write_kv_ref(batch.k, batch.v, *caches, m.slot_mapping, *scales)
    q = batch.q if q is None else q(batch.q)
    scale = head_dim ** -0.5
    args = (*caches, m.block_tables, m.query_start_loc, m.seq_lens)
    out = torch.full_like(batch.q, float("nan"))
    paged_context_attention(q, *args, m.max_query_len, scale, sliding_window, out=out,
                            k_scale=scales[0], v_scale=scales[1],
                            logits_soft_cap=logits_soft_cap, attention_chunk_size=chunk)
    ref = paged_attention_ref(q, *args, scale, sliding_window, kv_scales=scales,
                              logits_soft_cap=logits_soft_cap, chunk_size=chunk)
    err = relative_error(out, ref)
    assert err < TOL[dtype], err
    if logits_soft_cap is not None:  # the cap changes the result far beyond the tolerance
        uncapped = paged_attention_ref(q, *args, scale, sliding_window, kv_scales=scales)
        assert relative_error(uncapped, ref) > 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_dtypes_and_gqa(device, dtype, num_kv_heads):
    # a decode-like request (query_len 1) rides along with prefills that have prefixes
    check(device, [23, 1, 40], [0, 17, 9], num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens_per_block", [16, 32])
@pytest.mark.parametrize("prefix_lens", [[0, 0], [33, 100]])
def test_head_dims_block_sizes_prefixes(device, head_dim, tokens_per_block, prefix_lens):
    # 70 queries: two 128-row tiles per head would be one; the second tile is partial
    check(device, [70, 5], prefix_lens, head_dim=head_dim, tokens_per_block=tokens_per_block)


@pytest.mark.parametrize("head_dim", [96, 256])
def test_other_head_dims(device, head_dim):
    check(device, [20, 9], [5, 40], head_dim=head_dim)


def test_short_chunks(device):
    # max query length <= 16 picks the 16-row tile (chunked prefill, mixed decode)
    check(device, [16, 3, 1], [50, 0, 130], dtype=torch.float32)


def test_many_decodes_around_one_prefill(device):
    # the flattened grid maps tiles to sequences by binary search over query_start_loc
    query_lens = [1] * 6 + [90] + [1] * 5 + [2]
    check(device, query_lens, [(7 * i) % 40 for i in range(len(query_lens))],
          dtype=torch.float32)


@pytest.mark.parametrize("window", [8, 50])
def test_sliding_window(device, window):
    check(device, [45, 2], [30, 90], sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logits_soft_cap, window", [(0.5, None), (2.0, None), (1.0, 8)])
def test_logits_soft_cap(device, dtype, logits_soft_cap, window):
    # Gemma 2: scores -> cap * tanh(scores / cap) before the mask; prefixes, a decode
    # request, a partial tile, and a window shorter than the chunk
    check(device, [45, 1, 20], [30, 90, 0], dtype=dtype, sliding_window=window,
          logits_soft_cap=logits_soft_cap)


def test_logits_soft_cap_fp8_cache_gqa(device):
    check(device, [23, 1, 40], [0, 17, 9], num_kv_heads=1, head_dim=96,
          kv_scales=(0.013, 0.031), logits_soft_cap=1.5)


def test_strided_query(device):
    # q as the leading slice of a fused qkv projection output
    def q_view(q):
        fused = torch.randn(q.shape[0], q.shape[1] + 4, q.shape[2], dtype=q.dtype,
                            device=q.device)
        fused[:, :q.shape[1]] = q
        return fused[:, :q.shape[1]]
    check(device, [30, 7], [0, 21], q=q_view)


@pytest.mark.skipif(not CUDA, reason="large shapes run on the GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_on_gpu(device, dtype):
    check(device, [1000, 517, 1, 2048], [0, 3000, 4095, 37], num_heads=32, num_kv_heads=8,
          head_dim=128, dtype=dtype)
    check(device, [777, 300], [10, 5000], num_heads=32, num_kv_heads=8, head_dim=128,
          dtype=dtype, sliding_window=1024)
    check(device, [1] * 200 + [1500] + [1] * 55, [int(x) for x in torch.randint(0, 3000, (256,))],
          num_heads=32, num_kv_heads=8, head_dim=128, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_fp8_cache(device, dtype, head_dim):
    # e4m3 keys and values widened in registers; scales folded into the softmax and output
    check(device, [23, 1, 40], [0, 17, 9], head_dim=head_dim, dtype=dtype,
          kv_scales=(0.013, 0.031))


def test_fp8_cache_sliding_window(device):
    check(device, [45, 2], [30, 90], sliding_window=8, kv_scales=(0.5, 2.0))


@pytest.mark.skipif(not CUDA, reason="large shapes run on the GPU only")
def test_fp8_cache_large_on_gpu(device):
    check(device, [1000, 517, 1, 2048], [0, 3000, 4095, 37], num_heads=32, num_kv_heads=8,
          head_dim=128, kv_scales=(0.02, 0.01))


@pytest.mark.parametrize("chunk,window", [(8, None), (50, 50), (300, None)])
def test_chunked_attention(device, chunk, window):
    """Llama 4's chunked local attention: a query sees its own chunk's keys only; prompts
    that cross several chunks, after a prefix and within one."""
    check(device, [45, 2, 70], [30, 90, 0], chunk=chunk, sliding_window=window)
