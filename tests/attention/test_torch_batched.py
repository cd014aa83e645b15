"""The torch backend's batched paged attention against the per-sequence reference
(`paged_attention_ref`), computed in float32 from the same inputs: random batch compositions,
block sizes, GQA groups, sliding windows, fp8 caches, bf16 and fp32."""
import random

import pytest
import torch

from tllm.attention.testing import make_paged_batch, relative_error
from tllm.attention.torch_ref import (TorchAttentionBackend, paged_attention_batched,
                                      paged_attention_ref, plan_attention)
from tllm.kernels.paged import to_cache, write_kv_cache

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
FP8 = torch.float8_e4m3fn


def random_step(rng: random.Random, kind: str, num_seqs: int, block: int):
    """(query_lens, prefix_lens) of one step. Prefix-reused sequences start mid-context at a
    block boundary; chunks of a prefill continue after any number of computed tokens."""
    query_lens, prefix_lens = [], []
    for _ in range(num_seqs):
        seq_kind = rng.choice(["decode", "prefill", "chunk", "reused"]) if kind == "mixed" \
            else kind
        if seq_kind == "decode":
            query_lens.append(1)
            prefix_lens.append(rng.randint(0, 150))
        elif seq_kind == "prefill":
            query_lens.append(rng.randint(2, 70))
            prefix_lens.append(0)
        elif seq_kind == "chunk":
            query_lens.append(rng.randint(2, 50))
            prefix_lens.append(rng.randint(1, 120))
        else:  # prefix reuse: whole cached blocks, then the rest of the prompt
            query_lens.append(rng.randint(1, 40))
            prefix_lens.append(block * rng.randint(1, max(1, 96 // block)))
    return query_lens, prefix_lens


def make_step(query_lens, prefix_lens, num_kv_heads, group, head_dim, block, dtype,
              kv_scales=None):
    """A random step whose new keys and values are already in the cache (fp8 with
    kv_scales)."""
    batch = make_paged_batch(query_lens, prefix_lens, num_kv_heads * group, num_kv_heads,
                             head_dim, block, dtype)
    cache, scales = batch.kv_cache, (1.0, 1.0)
    if kv_scales is not None:
        fp8 = torch.empty(0, dtype=FP8)
        cache, scales = tuple(to_cache(c, fp8, s) for c, s in zip(cache, kv_scales)), kv_scales
    write_kv_cache(batch.k, batch.v, cache, batch.metadata.slot_mapping, scales)
    poison_unwritten(cache, batch.metadata)
    return batch, cache, scales


def poison_unwritten(cache, metadata):
    """NaN and inf in every slot no sequence owns, as a fresh torch.empty cache or a freed
    request's blocks may hold: a masked-out key must not reach the output as 0 * NaN."""
    bs = metadata.tokens_per_block
    owned = torch.zeros(cache[0].shape[0] * bs, dtype=torch.bool)
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        pos = torch.arange(seq_len)
        owned[metadata.block_tables[i, pos // bs].long() * bs + pos % bs] = True
    for c in cache:
        flat = c.view(-1, *c.shape[2:])
        if c.dtype == FP8:  # 0x7f is e4m3's NaN
            flat.view(torch.uint8)[~owned] = 0x7F
        else:
            flat[~owned] = float("nan")
            flat[~owned & (torch.arange(len(owned)) % 2 == 0)] = float("inf")


def reference(batch, cache, scale, window, scales, logits_soft_cap=None):
    """The per-sequence loop in float32 from the same inputs."""
    as_fp32 = tuple(c if c.dtype == FP8 else c.float() for c in cache)
    return paged_attention_ref(batch.q.float(), as_fp32, batch.metadata, scale, window, scales,
                               logits_soft_cap)


def check(query_lens, prefix_lens, num_kv_heads=2, group=3, head_dim=32, block=16,
          dtype=torch.float32, window=None, kv_scales=None, min_groups=1,
          logits_soft_cap=None):
    batch, cache, scales = make_step(query_lens, prefix_lens, num_kv_heads, group, head_dim,
                                     block, dtype, kv_scales)
    scale = head_dim ** -0.5
    out = torch.full_like(batch.q, float("nan"))  # poisoned: rows left unwritten show
    got = paged_attention_batched(batch.q, cache, batch.metadata, scale, window, scales,
                                  out=out, logits_soft_cap=logits_soft_cap)
    assert got is out
    ref = reference(batch, cache, scale, window, scales, logits_soft_cap)
    err = relative_error(out, ref)
    what = f"query_lens={query_lens} prefix_lens={prefix_lens} block={block} window={window}"
    assert not out.isnan().any(), what
    assert err < TOL[dtype], f"{err} {what}"
    groups = plan_attention(batch.metadata, window, dtype, 1, batch.q.shape[1], head_dim)
    assert len(groups) >= min_groups, what
    return groups


@pytest.mark.parametrize("kind", ["decode", "prefill", "chunk", "reused", "mixed"])
@pytest.mark.parametrize("block", [1, 4, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_random_batches(kind, block, group):
    rng = random.Random(f"{kind}-{block}-{group}")
    for _ in range(3):
        num_seqs = rng.randint(1, 9)
        check(*random_step(rng, kind, num_seqs, block), num_kv_heads=rng.choice([1, 2]),
              group=group, block=block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_scales", [None, (0.05, 0.02)])
def test_dtypes_and_fp8_caches(dtype, kv_scales):
    rng = random.Random(f"{dtype}-{kv_scales}")
    for _ in range(3):
        check(*random_step(rng, "mixed", rng.randint(2, 8), 16), dtype=dtype,
              kv_scales=kv_scales)


@pytest.mark.parametrize("window", [1, 7, 16, 50, 400])
@pytest.mark.parametrize("block", [1, 4, 32])
def test_sliding_windows(window, block):
    # windows shorter than a block, longer than every context, and in between; with a
    # window the gather starts at the first block a query still sees
    rng = random.Random(f"{window}-{block}")
    for kind in ("decode", "mixed"):
        check(*random_step(rng, kind, rng.randint(2, 8), block), block=block, window=window)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype, kv_scales", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.float32, (0.05, 0.02))])
def test_logits_soft_cap(kind, window, dtype, kv_scales):
    # the capped path computes its scores explicitly, with the plan's masks (fresh prefills:
    # SDPA's causal mask, made explicit) and the NaN-poisoned unowned slots
    rng = random.Random(f"cap-{kind}-{window}-{dtype}-{kv_scales}")
    for _ in range(2):
        check(*random_step(rng, kind, rng.randint(2, 7), rng.choice([1, 4, 16])),
              num_kv_heads=rng.choice([1, 2]), dtype=dtype, window=window,
              kv_scales=kv_scales, logits_soft_cap=rng.choice([0.5, 2.0]))


@pytest.mark.parametrize("window", [None, 5])
def test_soft_capped_reference_matches_kernel_reference(window):
    """The per-sequence loop against the kernels' independent float32 reference, and the
    cap changes the result."""
    from tllm.kernels.triton.attention_ref import paged_attention_ref as kernel_ref
    batch, cache, scales = make_step([9, 1, 30], [20, 44, 0], 2, 3, 32, 4, torch.float32)
    m, scale = batch.metadata, 32 ** -0.5
    args = (batch.q, *cache, m.block_tables, m.query_start_loc, m.seq_lens, scale, window)
    ref = reference(batch, cache, scale, window, scales, 1.0)
    assert relative_error(ref, kernel_ref(*args, logits_soft_cap=1.0)) < 1e-6
    assert relative_error(ref, kernel_ref(*args)) > 1e-2


def test_prefill_next_to_decodes_is_split():
    # one padded call would pad 31 decodes to 256 queries: the plan keeps them apart, and
    # every group's rows land where they belong
    query_lens = [1] * 12 + [256] + [1] * 12
    prefix_lens = [random.randint(30, 300) for _ in range(25)]
    groups = check(query_lens, prefix_lens, num_kv_heads=3, group=3, head_dim=64, block=32,
                   min_groups=2)
    assert any(g.max_query_len == 256 and g.num_seqs == 1 for g in groups)


def test_fresh_prefills_use_sdpa_causal():
    groups = check([40, 37, 33], [0, 0, 0], block=16)
    assert all(g.is_causal and g.mask is None for g in groups)


def test_whole_decode_batch_is_one_call_without_indexing():
    groups = check([1] * 6, [63, 12, 40, 99, 5, 70], block=16)
    assert len(groups) == 1 and groups[0].q_rows is None and groups[0].out_rows is None


def test_backend_plans_once_per_step():
    """The backend reuses its plan across layers of one step (same metadata, other caches)
    and builds a new one for the next step."""
    num_kv_heads, group, head_dim = 2, 2, 32
    backend = TorchAttentionBackend(num_kv_heads * group, num_kv_heads, head_dim,
                                    head_dim ** -0.5)
    for query_lens, prefix_lens in (([5, 1, 1], [0, 40, 17]), ([1, 1, 1], [5, 41, 18])):
        batch, cache, _ = make_step(query_lens, prefix_lens, num_kv_heads, group, head_dim, 4,
                                    torch.float32)
        layers = [cache, tuple(torch.randn_like(c) for c in cache)]
        for layer_cache in layers:
            out = backend.forward(batch.q, batch.k, batch.v, layer_cache, batch.metadata)
            ref = reference(batch, layer_cache, backend.scale, None, (1.0, 1.0))
            assert relative_error(out, ref) < 1e-5
        assert backend._plans[-1][0] is batch.metadata
    assert len(backend._plans) == 2  # one plan per step (per metadata object), not per layer
