"""MLA decode kernel (absorbed form, paged latent cache) vs its float32 reference, and the
reference vs the torch backend's MLA path (tllm.attention.mla) on the same batch."""
import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.mla import mla_attention_ref, query_rows_as_sequences  # noqa: E402
from tllm.attention.testing import make_paged_batch, relative_error  # noqa: E402
from tllm.kernels.triton.mla_decode import mla_decode_attention, mla_decode_ref  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def decode_batch(prefix_lens, num_heads, latent_dim, rope_dim, tokens_per_block, dtype,
                 device):
    """A decode step (one new token per sequence) over random cached latents; the new
    tokens' rows are in the cache already (the backend writes them before attending)."""
    batch = make_paged_batch([1] * len(prefix_lens), prefix_lens, num_heads, 1,
                             latent_dim + rope_dim, tokens_per_block, dtype, device)
    return batch.q, batch.kv_cache[0], batch.metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,latent_dim,rope_dim,tokens_per_block",
                         [(4, 32, 8, 4), (20, 64, 16, 16)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_matches_reference(device, dtype, num_heads, latent_dim, rope_dim,
                                  tokens_per_block, num_splits):
    # lengths across tile edges, a one-token context among them
    q, cache, m = decode_batch([0, 45, 16, 70], num_heads, latent_dim, rope_dim,
                               tokens_per_block, dtype, device)
    scale = (latent_dim // 2 + rope_dim) ** -0.5
    out = torch.full((q.shape[0], num_heads, latent_dim), float("nan"), dtype=dtype,
                     device=device)
    mla_decode_attention(q, cache, m.block_tables, m.seq_lens, latent_dim, scale,
                         m.max_seq_len, num_splits, m.query_start_loc, out=out)
    ref = mla_decode_ref(q, cache, m.block_tables, m.seq_lens, latent_dim, scale)
    assert relative_error(out, ref) < TOL[dtype]


def test_splits_chosen_for_one_sequence(device):
    """Batch 1: the context is split over programs (merged by log-sum-exp)."""
    q, cache, m = decode_batch([600], 4, 32, 8, 16, torch.float32, device)
    out = mla_decode_attention(q, cache, m.block_tables, m.seq_lens, 32, 0.2)
    ref = mla_decode_ref(q, cache, m.block_tables, m.seq_lens, 32, 0.2)
    assert relative_error(out, ref) < 1e-5


def test_torch_path_matches_reference():
    q, cache, m = decode_batch([3, 30, 11], 4, 32, 8, 4, torch.float32, "cpu")
    scale = 0.3
    ours = mla_attention_ref(q, cache, m, 32, scale)
    ref = mla_decode_ref(q, cache, m.block_tables, m.seq_lens, 32, scale)
    assert relative_error(ours, ref) < 1e-5


@pytest.mark.parametrize("query_lens", [[2, 2, 2], [4, 1, 3, 2]])
def test_query_rows_as_sequences_give_causal_attention(device, query_lens):
    """A verify step (several query tokens per sequence, causal) through the decode kernel,
    a query row at a time, equals the batched torch path; rows past the last sequence's (a
    CUDA graph's padding) see no keys and leave the real rows alone."""
    batch = make_paged_batch(query_lens, [0, 37, 5, 20][:len(query_lens)], 4, 1, 40, 4,
                             torch.float32, device)
    q, cache, m = batch.q, batch.kv_cache[0], batch.metadata
    padding = 3
    padded_q = torch.cat([q, torch.randn(padding, *q.shape[1:], device=device)])
    lens, tables = query_rows_as_sequences(m.query_start_loc, m.seq_lens, m.block_tables,
                                           padded_q.shape[0])
    assert lens[-padding:].tolist() == [0] * padding
    out = mla_decode_attention(padded_q, cache, tables, lens, 32, 0.2, m.max_seq_len)
    ref = mla_attention_ref(q.cpu(), cache.cpu(), _on_cpu(m), 32, 0.2)
    assert relative_error(out[:q.shape[0]].cpu(), ref) < 1e-5


def _on_cpu(metadata):
    import dataclasses
    return dataclasses.replace(metadata, **{
        name: getattr(metadata, name).cpu() for name in
        ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")})


def test_rejects_a_cache_of_another_width(device):
    q, cache, m = decode_batch([5], 4, 32, 8, 4, torch.float32, device)
    with pytest.raises(ValueError, match="cache must be"):
        mla_decode_attention(q[..., :-1], cache, m.block_tables, m.seq_lens, 32, 0.1)
