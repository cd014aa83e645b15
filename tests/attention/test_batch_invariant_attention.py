"""The batch-invariant attention backend (deterministic mode): close to the per-sequence
reference, and bit for bit the same output for a query token however its step is laid out
(alone, in a batch, as a decode, inside prefill chunks of any length)."""
import random

import pytest
import torch

from tllm.attention.interface import AttentionMetadata
from tllm.attention.invariant import BatchInvariantAttentionBackend
from tllm.attention.testing import make_paged_batch, relative_error
from tllm.attention.torch_ref import paged_attention_ref

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


@pytest.mark.parametrize("window,cap", [(None, None), (24, None), (None, 30.0)])
def test_matches_the_reference(window, cap):
    torch.manual_seed(0)
    batch = make_paged_batch([1, 5, 20, 1, 70], [70, 0, 30, 3, 60], HEADS, KV_HEADS, DIM,
                             BLOCK, torch.float32)
    backend = BatchInvariantAttentionBackend(HEADS, KV_HEADS, DIM, DIM ** -0.5, window, cap)
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata)
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.metadata, DIM ** -0.5, window,
                              logits_soft_cap=cap)
    assert relative_error(out, ref) < 1e-5


def test_sinks_and_chunks_match_the_reference():
    """GPT-OSS's sinks and Llama 4's chunked local attention, as the torch reference has them."""
    torch.manual_seed(0)
    batch = make_paged_batch([1, 5, 20, 1, 70], [70, 0, 30, 3, 60], HEADS, KV_HEADS, DIM,
                             BLOCK, torch.float32)
    sinks = torch.randn(HEADS)
    backend = BatchInvariantAttentionBackend(HEADS, KV_HEADS, DIM, DIM ** -0.5,
                                             attention_chunk_size=16)
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata,
                          sinks=sinks)
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.metadata, DIM ** -0.5,
                              sinks=sinks, chunk_size=16)
    assert relative_error(out, ref) < 1e-5


def test_non_causal_attention_is_refused():
    with pytest.raises(ValueError, match="non-causal"):
        BatchInvariantAttentionBackend(HEADS, KV_HEADS, DIM, DIM ** -0.5, causal=False)


def _metadata(tables: torch.Tensor, spans: list[tuple[int, int]]) -> AttentionMetadata:
    """Sequence i computes positions spans[i] = (first, end) over the context 0..end."""
    positions = torch.cat([torch.arange(a, b) for a, b in spans])
    seq_of = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(spans)])
    slots = tables[seq_of, positions // BLOCK].long() * BLOCK + positions % BLOCK
    query_lens = [b - a for a, b in spans]
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        positions=positions, slot_mapping=slots, query_start_loc=starts,
        seq_lens=torch.tensor([b for _, b in spans], dtype=torch.int32), block_tables=tables,
        max_query_len=max(query_lens), max_seq_len=max(b for _, b in spans),
        tokens_per_block=BLOCK, query_lens_cpu=query_lens, seq_lens_cpu=[b for _, b in spans])


def test_a_token_is_the_same_bits_in_any_layout():
    """A probe sequence of 90 tokens (its q/k/v fixed) computed in random layouts: chunks of
    random lengths, each in a step with random other sequences."""
    rng = random.Random(0)
    torch.manual_seed(0)
    length, num_blocks = 90, 400
    q, k, v = (torch.randn(length, h, DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    backend = BatchInvariantAttentionBackend(HEADS, KV_HEADS, DIM, DIM ** -0.5)
    reference = None
    for trial in range(6):
        cache = (torch.randn(num_blocks, BLOCK, KV_HEADS, DIM),
                 torch.randn(num_blocks, BLOCK, KV_HEADS, DIM))
        blocks = torch.randperm(num_blocks).to(torch.int32)
        out, done = torch.empty(length, HEADS, DIM), 0
        while done < length:
            end = length if trial == 0 else min(length, done + rng.choice((1, 1, 3, 8, 9, 40)))
            others = [(p, p + rng.choice((1, 7, 30))) for p in
                      (rng.randrange(0, 60) for _ in range(0 if trial == 0 else rng.randint(0, 5)))]
            at = rng.randint(0, len(others))
            spans = others[:at] + [(done, end)] + others[at:]
            # the probe keeps its own blocks (its earlier chunks' keys stay there)
            tables = [blocks[40 * i:40 * (i + 1)] for i in range(len(others))]
            meta = _metadata(torch.stack(tables[:at] + [blocks[-40:]] + tables[at:]), spans)
            rows = meta.query_start_loc[at].item()
            step_q = torch.randn(meta.positions.shape[0], HEADS, DIM)
            step_k = torch.randn(meta.positions.shape[0], KV_HEADS, DIM)
            step_v = torch.randn(meta.positions.shape[0], KV_HEADS, DIM)
            mine = slice(rows, rows + end - done)
            step_q[mine], step_k[mine], step_v[mine] = q[done:end], k[done:end], v[done:end]
            out[done:end] = backend.forward(step_q, step_k, step_v, cache, meta)[mine]
            done = end
        if reference is None:
            reference = out
        assert torch.equal(out, reference), trial
