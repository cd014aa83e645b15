"""Paged decode attention kernel (GQA-grouped, split-K) vs the float32 torch reference."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import make_paged_batch, relative_error  # noqa: E402
from tllm.kernels.triton.decode_attention import (choose_num_splits,  # noqa: E402
                                                  paged_attention_ref, paged_decode_attention)
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


def check(device, prefix_lens, query_lens=None, num_heads=8, num_kv_heads=2, head_dim=64,
          tokens_per_block=16, dtype=torch.bfloat16, num_splits=None, sliding_window=None,
          kv_scales=None, logits_soft_cap=None, chunk=None):
    query_lens = query_lens or [1] * len(prefix_lens)
    batch = make_paged_batch(query_lens, prefix_lens, num_heads, num_kv_heads, head_dim,
                             tokens_per_block, dtype, device)
    m = batch.metadata
    caches, scales = fp8_caches(batch.kv_cache, kv_scales)
    write_kv_ref(batch.k, batch.v, *caches, m.slot_mapping, *scales)
    scale = head_dim ** -0.5
    args = (*caches, m.block_tables, m.query_start_loc, m.seq_lens)
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(batch.q, *args, m.max_seq_len, scale, m.max_query_len,
                           sliding_window, num_splits, out=out, k_scale=scales[0],
                           v_scale=scales[1], logits_soft_cap=logits_soft_cap,
                           attention_chunk_size=chunk)
    ref = paged_attention_ref(batch.q, *args, scale, sliding_window, scales, logits_soft_cap,
                              chunk_size=chunk)
    err = relative_error(out, ref)
    assert err < TOL[dtype], err
    if logits_soft_cap is not None:  # the cap changes the result far beyond the tolerance
        uncapped = paged_attention_ref(batch.q, *args, scale, sliding_window, scales)
        assert relative_error(uncapped, ref) > 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_dtypes_and_gqa(device, dtype, num_kv_heads):
    # very different lengths in one launch, including a context of one token
    check(device, [0, 16, 299, 63], num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens_per_block", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_head_dims_block_sizes_splits(device, head_dim, tokens_per_block, num_splits):
    check(device, [200, 31, 5], head_dim=head_dim, tokens_per_block=tokens_per_block,
          num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_several_queries_per_sequence(device, dtype, num_splits):
    # speculative verification: 1..4 draft tokens, each causal within the step; 124 + 4
    # ends on a tile boundary, so the draft tokens share a whole 64-key tile
    check(device, [30, 124, 5, 0], query_lens=[2, 4, 1, 3], dtype=dtype,
          num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, num_splits", [(2, 1), (2, 3), (1, 2)])
def test_up_to_eight_queries_per_sequence(device, dtype, num_kv_heads, num_splits):
    # verify steps of k = 7 drafts: 8 queries a sequence, GQA groups of 4 and 8 (32 and 64
    # tile rows); 120 + 8 ends on a tile boundary, 57 + 7 starts the drafts mid-tile
    check(device, [120, 57, 5, 0], query_lens=[8, 7, 1, 8], num_kv_heads=num_kv_heads,
          dtype=dtype, num_splits=num_splits)


def test_more_than_eight_queries_are_refused(device):
    with pytest.raises(ValueError, match="at most 8 queries"):
        check(device, [10], query_lens=[9])


@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window(device, num_splits):
    # the 4-query request's window starts just below a 64-key tile boundary (190 < 192)
    check(device, [250, 20, 226], query_lens=[1, 2, 4], sliding_window=37,
          num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("logits_soft_cap, window", [(0.5, None), (2.0, 37)])
def test_logits_soft_cap(device, dtype, num_splits, logits_soft_cap, window):
    # Gemma 2: scores -> cap * tanh(scores / cap) before the mask, split partitions merged
    # by their log-sum-exp of the capped scores
    check(device, [250, 20, 0, 63], query_lens=[1, 2, 1, 4], dtype=dtype,
          num_splits=num_splits, sliding_window=window, logits_soft_cap=logits_soft_cap)


def test_logits_soft_cap_fp8_cache(device):
    check(device, [250, 20], query_lens=[1, 3], num_kv_heads=1, num_splits=2,
          kv_scales=(0.5, 2.0), logits_soft_cap=1.0)


@pytest.mark.parametrize("head_dim", [96, 256])
def test_other_head_dims(device, head_dim):
    check(device, [77, 140], head_dim=head_dim, num_splits=2)


def test_num_splits_fills_the_gpu_without_tiny_partitions():
    cpu = torch.device("cpu")  # counts as a GPU of 8 SMs
    assert choose_num_splits(1, 1, 100, cpu) == 1           # too short to split
    assert choose_num_splits(64, 8, 1 << 20, cpu) == 1      # the batch fills the GPU
    long_context = choose_num_splits(1, 1, 1 << 20, cpu)
    assert long_context >= 8                                # at least one program an SM
    assert choose_num_splits(4, 1, 1 << 20, cpu) <= long_context
    assert choose_num_splits(1, 1, 1024, cpu) <= 1024 // 256  # partitions >= 256 tokens


@pytest.mark.skipif(not CUDA, reason="large shapes run on the GPU only")
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_large_on_gpu(device, num_splits):
    prefix_lens = [int(x) for x in torch.randint(1, 8192, (33,))] + [16383]
    check(device, prefix_lens, num_heads=32, num_kv_heads=8, head_dim=128, num_splits=num_splits)
    check(device, [5000, 100, 12000], query_lens=[4, 3, 1], num_heads=32, num_kv_heads=8,
          head_dim=128, num_splits=num_splits, sliding_window=4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache(device, dtype, num_splits):
    # e4m3 keys and values widened in registers; scales folded into the softmax and output
    check(device, [0, 16, 299, 63], query_lens=[1, 2, 1, 4], dtype=dtype,
          num_splits=num_splits, kv_scales=(0.013, 0.031))


def test_fp8_cache_sliding_window(device):
    check(device, [250, 20], query_lens=[1, 3], num_splits=2, sliding_window=37,
          kv_scales=(0.5, 2.0))


@pytest.mark.skipif(not CUDA, reason="large shapes run on the GPU only")
def test_fp8_cache_large_on_gpu(device):
    prefix_lens = [int(x) for x in torch.randint(1, 8192, (33,))] + [16383]
    check(device, prefix_lens, num_heads=32, num_kv_heads=8, head_dim=128,
          kv_scales=(0.02, 0.01))


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("chunk,window", [(16, None), (37, 37), (200, None)])
def test_chunked_attention(device, num_splits, chunk, window):
    """Llama 4's chunked local attention: a query sees its own chunk's keys only; the
    verify rows of one request may straddle a chunk boundary (150..153 across 148)."""
    check(device, [250, 20, 150, 63], query_lens=[1, 2, 4, 1], chunk=chunk,
          sliding_window=window, num_splits=num_splits)
