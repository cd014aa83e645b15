"""The attention backends' non-causal mode (encoder-only models): every query of a sequence
sees all its keys; the torch backend checked against plain SDPA without a mask per
sequence, the Triton backend against the torch backend."""
import pytest
import torch
import torch.nn.functional as F

from tllm.attention.testing import make_paged_batch, relative_error
from tllm.attention.torch_ref import TorchAttentionBackend
from tllm.kernels.paged import gather_kv


@pytest.mark.parametrize("query_lens", [[7], [5, 1, 12, 3], [16, 16], [1, 1]])
@pytest.mark.parametrize("block", [1, 4, 16])
def test_non_causal_sees_every_key_of_its_sequence(query_lens, block):
    heads, kv_heads, head_dim = 4, 2, 16
    batch = make_paged_batch(query_lens, [0] * len(query_lens), heads, kv_heads, head_dim,
                             block, torch.float32)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim, head_dim ** -0.5, causal=False)
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata)
    start, meta = 0, batch.metadata
    for i, n in enumerate(query_lens):
        k, v = gather_kv(batch.kv_cache, meta.block_tables[i], n, block)
        q = batch.q[start:start + n].transpose(0, 1)
        ref = F.scaled_dot_product_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), scale=head_dim ** -0.5,
            enable_gqa=True).transpose(0, 1)
        assert relative_error(out[start:start + n], ref) < 1e-5
        start += n
    causal = TorchAttentionBackend(heads, kv_heads, head_dim, head_dim ** -0.5)
    if max(query_lens) > 1:  # the mode changes something
        assert not torch.allclose(causal.forward(batch.q, batch.k, batch.v, batch.kv_cache,
                                                 batch.metadata), out)


@pytest.mark.parametrize("window", [1, 3])
def test_non_causal_window_sees_both_sides(window):
    """ModernBERT's local layers: keys less than `window` positions away, either side."""
    heads, head_dim, query_lens = 2, 8, [9, 4]
    batch = make_paged_batch(query_lens, [0, 0], heads, heads, head_dim, 4, torch.float32)
    out = TorchAttentionBackend(heads, heads, head_dim, head_dim ** -0.5, window,
                                causal=False).forward(batch.q, batch.k, batch.v,
                                                      batch.kv_cache, batch.metadata)
    start = 0
    for i, n in enumerate(query_lens):
        k, v = gather_kv(batch.kv_cache, batch.metadata.block_tables[i], n, 4)
        pos = torch.arange(n)
        mask = (pos[:, None] - pos[None, :]).abs() < window
        ref = F.scaled_dot_product_attention(
            batch.q[start:start + n].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=head_dim ** -0.5).transpose(0, 1)
        assert relative_error(out[start:start + n], ref) < 1e-5
        start += n


@pytest.mark.parametrize("query_lens,window", [([5, 1, 12], None), ([3], None),
                                               ([6, 2], 2)])
def test_triton_non_causal_equals_torch(device, query_lens, window):
    """The context kernel's non-causal mode (every step of an encoder goes to it, short
    queries too), under the Triton interpreter on a CPU; a windowed layer's torch path."""
    pytest.importorskip("triton")
    from tllm.attention.triton_backend import TritonAttentionBackend
    heads, kv_heads, head_dim = 4, 2, 16
    batch = make_paged_batch(query_lens, [0] * len(query_lens), heads, kv_heads, head_dim, 4,
                             torch.float32, device=device)
    args = (heads, kv_heads, head_dim, head_dim ** -0.5, window)
    got = TritonAttentionBackend(*args, causal=False).forward(
        batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata)
    ref = TorchAttentionBackend(*args, causal=False).forward(
        batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata)
    assert relative_error(got, ref) < 1e-5
