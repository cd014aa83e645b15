"""Chunked local attention (Llama 4's `attention_chunk_size`): the torch backend's batched
path against the per-sequence reference, the reference's mask against a direct statement of
the rule, and the Triton backend's refusal."""
import random

import pytest
import torch

from tests.attention.test_torch_batched import make_step, random_step
from tllm.attention.testing import relative_error
from tllm.attention.torch_ref import paged_attention_batched, paged_attention_ref
from tllm.kernels.paged import causal_mask


@pytest.mark.parametrize("chunk", [1, 5, 16, 300])
@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("window", [None, "chunk"])
def test_batched_matches_reference(chunk, block, window):
    # chunks shorter than a block, not a multiple of it, and longer than every context; the
    # cache may keep only a window of the chunk size (what the KV cache groups drop)
    window = chunk if window == "chunk" else None
    rng = random.Random(f"{chunk}-{block}-{window}")
    for kind in ("decode", "chunk", "reused", "mixed"):
        steps = random_step(rng, kind, rng.randint(2, 7), block)
        batch, cache, scales = make_step(*steps, num_kv_heads=2, group=2, head_dim=16,
                                         block=block, dtype=torch.float32)
        scale = 16 ** -0.5
        out = paged_attention_batched(batch.q, cache, batch.metadata, scale, window, scales,
                                      chunk_size=chunk)
        ref = paged_attention_ref(batch.q, cache, batch.metadata, scale, window, scales,
                                  chunk_size=chunk)
        assert not out.isnan().any()
        assert relative_error(out, ref) < 1e-5, (kind, steps)


def test_reference_mask_is_the_chunk_rule():
    mask = causal_mask(5, 12, None, torch.device("cpu"), chunk_size=4)  # positions 7..11
    for row, q_pos in enumerate(range(7, 12)):
        expected = [q_pos // 4 == k_pos // 4 and k_pos <= q_pos for k_pos in range(12)]
        assert mask[row].tolist() == expected


def test_triton_backend_refuses_chunked_attention():
    from tllm.attention.triton_backend import TritonAttentionBackend
    with pytest.raises(ValueError, match="chunked local attention"):
        TritonAttentionBackend(4, 2, 16, 0.25, attention_chunk_size=8)
