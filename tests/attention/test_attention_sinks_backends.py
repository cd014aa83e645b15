"""Attention sinks through both backends: the torch backend's batched path against its
per-sequence reference, and the Triton backend against the torch backend on one step."""
import pytest
import torch

from tllm.attention import get_attention_backend
from tllm.attention.testing import make_paged_batch, relative_error
from tllm.attention.torch_ref import paged_attention_ref

# decodes first (the decode kernel), then a prefill, a decode and a chunk after a prefix
QUERY_LENS, PREFIX_LENS = [1, 1, 12, 1, 20], [70, 3, 0, 33, 50]


def attend(device, name, batch, sinks, window, num_heads=4, num_kv_heads=2, head_dim=16):
    backend = get_attention_backend(name)(num_heads, num_kv_heads, head_dim, head_dim ** -0.5,
                                          window)
    cache = tuple(c.clone() for c in batch.kv_cache)
    out = backend.forward(batch.q, batch.k, batch.v, cache, batch.metadata, sinks=sinks)
    return out, cache


@pytest.mark.parametrize("window", [None, 16])
def test_torch_backend_sinks_match_per_sequence_reference(device, window):
    batch = make_paged_batch(QUERY_LENS, PREFIX_LENS, 4, 2, 16, 16, torch.float32, device)
    sinks = torch.randn(4, device=device) * 2 + 1
    out, cache = attend(device, "torch", batch, sinks, window)
    ref = paged_attention_ref(batch.q, cache, batch.metadata, 16 ** -0.5, window, sinks=sinks)
    assert relative_error(out, ref) < 1e-5
    without = paged_attention_ref(batch.q, cache, batch.metadata, 16 ** -0.5, window)
    assert relative_error(without, ref) > 1e-3


@pytest.mark.parametrize("window", [None, 16])
def test_triton_backend_sinks_match_torch_backend(device, window):
    pytest.importorskip("triton")
    batch = make_paged_batch(QUERY_LENS, PREFIX_LENS, 4, 2, 16, 16, torch.float32, device)
    sinks = torch.randn(4, device=device) * 2 + 1
    ours, _ = attend(device, "triton", batch, sinks, window)
    theirs, _ = attend(device, "torch", batch, sinks, window)
    assert relative_error(ours, theirs) < 1e-5
