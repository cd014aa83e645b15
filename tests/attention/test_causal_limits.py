"""Attention with per-token causal limits (Gemma 3's image tokens seeing their whole image):
limits equal to the positions give the ordinary causal answer; an image block's queries
see its later keys, as a dense masked softmax does; the Triton backend hands such steps to
the same path."""
import pytest
import torch

from tllm.attention import get_attention_backend
from tllm.attention.testing import make_paged_batch, relative_error
from tllm.kernels.paged import gather_kv, soft_capped_attention


def attend(name, batch, limits=None, window=None, cap=None):
    backend = get_attention_backend(name)(4, 2, 16, 0.25, window, logits_soft_cap=cap)
    batch.metadata.causal_limits = limits
    cache = tuple(c.clone() for c in batch.kv_cache)
    return backend.forward(batch.q, batch.k, batch.v, cache, batch.metadata), cache


@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 2.0)])
def test_limits_at_the_positions_are_causal(device, window, cap):
    batch = make_paged_batch([9, 1, 6], [0, 7, 11], 4, 2, 16, 4, torch.float32, device)
    causal, _ = attend("torch", batch, None, window, cap)
    limited, _ = attend("torch", batch, batch.metadata.positions.clone(), window, cap)
    assert relative_error(limited, causal) < 1e-6


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_an_image_block_sees_its_later_keys(device, name):
    """Sequence 1 (3 cached tokens, 8 new at positions 3..10) has an image at 5..8."""
    if name == "triton":
        pytest.importorskip("triton")
    batch = make_paged_batch([1, 8], [6, 3], 4, 2, 16, 4, torch.float32, device)
    limits = batch.metadata.positions.clone()
    limits[1 + 2:1 + 6] = 8
    out, cache = attend(name, batch, limits, window=6)
    k, v = gather_kv(cache, batch.metadata.block_tables[1], 11, 4)
    keys, queries = torch.arange(11, device=device), torch.arange(3, 11, device=device)
    allowed = (keys[None] <= limits[1:, None]) & (keys[None] > queries[:, None] - 6)
    expected = soft_capped_attention(batch.q[1:].transpose(0, 1), k.transpose(0, 1),
                                     v.transpose(0, 1), allowed, 0.25, None)
    assert relative_error(out[1:], expected.transpose(0, 1)) < 1e-5
    assert allowed[2, 8] and not allowed[1, 8]   # an image token sees its image's end
