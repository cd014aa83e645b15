"""Attention sinks (GPT-OSS: a learned logit per head in the softmax's denominator) in the
paged context and decode kernels, against the float32 torch reference."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.testing import make_paged_batch, relative_error  # noqa: E402
from tllm.kernels.triton.attention_ref import paged_attention_ref  # noqa: E402
from tllm.kernels.triton.context_attention import paged_context_attention  # noqa: E402
from tllm.kernels.triton.decode_attention import paged_decode_attention  # noqa: E402
from tllm.kernels.triton.kv_cache import write_kv_ref  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
HEAD_DIM = 16


def batch_and_sinks(device, query_lens, prefix_lens, dtype, num_heads=4, num_kv_heads=2):
    batch = make_paged_batch(query_lens, prefix_lens, num_heads, num_kv_heads, HEAD_DIM, 16,
                             dtype, device)
    m = batch.metadata
    write_kv_ref(batch.k, batch.v, *batch.kv_cache, m.slot_mapping, 1.0, 1.0)
    # large enough to move the result far beyond the tolerance
    sinks = (torch.randn(num_heads) * 2 + 1).to(device)
    args = (*batch.kv_cache, m.block_tables, m.query_start_loc, m.seq_lens)
    return batch, sinks, args


def check_against_ref(out, batch, args, sinks, dtype, window=None):
    scale = HEAD_DIM ** -0.5
    ref = paged_attention_ref(batch.q, *args, scale, window, sinks=sinks)
    assert relative_error(out, ref) < TOL[dtype]
    without = paged_attention_ref(batch.q, *args, scale, window)
    assert relative_error(without, ref) > 10 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 8])
def test_context_kernel_with_sinks(device, dtype, window):
    # a fresh prefill, a chunk after a cached prefix, a decode among them
    batch, sinks, args = batch_and_sinks(device, [20, 9, 1], [0, 23, 40], dtype)
    m = batch.metadata
    out = torch.full_like(batch.q, float("nan"))
    paged_context_attention(batch.q, *args, m.max_query_len, HEAD_DIM ** -0.5, window,
                            out=out, sinks=sinks)
    check_against_ref(out, batch, args, sinks, dtype, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_with_sinks(device, dtype, num_splits):
    # split-K merges the partitions and adds the sink once; a two-query verify step too
    batch, sinks, args = batch_and_sinks(device, [1, 2, 1], [70, 30, 0], dtype)
    m = batch.metadata
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention(batch.q, *args, m.max_seq_len, HEAD_DIM ** -0.5, m.max_query_len,
                           None, num_splits, out=out, sinks=sinks)
    check_against_ref(out, batch, args, sinks, dtype)


def test_sinks_shape_is_checked(device):
    batch, sinks, args = batch_and_sinks(device, [1], [5], torch.float32)
    m = batch.metadata
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(batch.q, *args, m.max_seq_len, 0.25, sinks=sinks[:2])
