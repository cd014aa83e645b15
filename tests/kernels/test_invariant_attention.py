"""The batch-invariant paged attention kernel (deterministic mode on CUDA): close to its
reference (the torch path of BatchInvariantAttentionBackend), and bit for bit the same
output for a token in any step layout."""
import random

import pytest
import torch

pytest.importorskip("triton")

from tllm.attention.interface import AttentionMetadata  # noqa: E402
from tllm.attention.invariant import BatchInvariantAttentionBackend  # noqa: E402
from tllm.attention.testing import make_paged_batch, relative_error  # noqa: E402
from tllm.kernels.paged import to_cache, write_kv_cache  # noqa: E402
from tllm.kernels.triton.invariant_attention import build_tiles  # noqa: E402

CUDA = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
QUERY_LENS, PREFIX_LENS = [1, 5, 20, 1, 37, 2], [70, 0, 30, 3, 60, 13]


def both_paths(batch, backend, kv_scales=(1.0, 1.0), sinks=None):
    """(kernel, torch reference) outputs of one step whose keys are written first."""
    m = batch.metadata
    write_kv_cache(batch.k, batch.v, batch.kv_cache, m.slot_mapping, kv_scales)
    out = backend._attend_kernel(batch.q, batch.kv_cache, m, kv_scales, sinks)
    ref = backend._attend_torch(batch.q, batch.kv_cache, m, kv_scales, sinks)
    return out, ref


def test_tile_table():
    # a decode at 70, a chunk at 0..4, a chunk at 30..49 (crosses 32 and 48), one at 16
    tiles = build_tiles([1, 5, 20, 1], [71, 5, 50, 17], "cpu").tolist()
    assert tiles == [[0, 64], [1, 0], [2, 16], [2, 32], [2, 48], [3, 16]]


def test_tile_table_is_built_once_per_step():
    batch = make_paged_batch([3, 1], [5, 9], 4, 2, 16, 4, torch.float32)
    backend = BatchInvariantAttentionBackend(4, 2, 16, 0.25)
    tiles = backend._tiles(batch.metadata)
    assert backend._tiles(batch.metadata) is tiles
    again = make_paged_batch([3, 1], [5, 9], 4, 2, 16, 4, torch.float32).metadata
    assert backend._tiles(again) is not tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,tokens_per_block", [(4, 4), (2, 16), (1, 8)])
def test_matches_the_torch_path(device, dtype, num_kv_heads, tokens_per_block):
    torch.manual_seed(0)
    batch = make_paged_batch(QUERY_LENS, PREFIX_LENS, 4, num_kv_heads, 32,
                             tokens_per_block, dtype, device)
    backend = BatchInvariantAttentionBackend(4, num_kv_heads, 32, 32 ** -0.5)
    out, ref = both_paths(batch, backend)
    assert relative_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("options", [
    dict(sliding_window=24), dict(sliding_window=5), dict(logits_soft_cap=0.8),
    dict(attention_chunk_size=16), dict(sliding_window=40, logits_soft_cap=2.0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_and_soft_cap(device, dtype, options):
    torch.manual_seed(1)
    batch = make_paged_batch(QUERY_LENS, PREFIX_LENS, 4, 2, 24, 4, dtype, device)
    backend = BatchInvariantAttentionBackend(4, 2, 24, 24 ** -0.5, **options)
    out, ref = both_paths(batch, backend)
    assert relative_error(out, ref) < TOL[dtype]


def test_sinks_and_fp8_cache(device):
    torch.manual_seed(2)
    batch = make_paged_batch(QUERY_LENS, PREFIX_LENS, 4, 2, 32, 8, torch.float32, device)
    fp8 = torch.empty(0, dtype=torch.float8_e4m3fn)
    scales = (0.013, 0.031)
    batch.kv_cache = tuple(to_cache(c, fp8, s) for c, s in zip(batch.kv_cache, scales))
    backend = BatchInvariantAttentionBackend(4, 2, 32, 32 ** -0.5)
    sinks = torch.randn(4, device=device)
    out, ref = both_paths(batch, backend, scales, sinks)
    assert relative_error(out, ref) < TOL[torch.float32]
    without, _ = both_paths(batch, backend, scales)
    assert relative_error(without, ref) > 100 * TOL[torch.float32]   # the sinks count


def test_scales_apply_to_fp8_caches_only(device):
    torch.manual_seed(3)
    batch = make_paged_batch(QUERY_LENS, PREFIX_LENS, 4, 2, 32, 8, torch.float32, device)
    backend = BatchInvariantAttentionBackend(4, 2, 32, 32 ** -0.5)
    out, ref = both_paths(batch, backend, (2.0, 3.0))
    assert relative_error(out, ref) < TOL[torch.float32]


# --- invariance: one probe request laid out in different steps --------------------------

HEADS, KV_HEADS, DIM, BLOCK, LENGTH = 4, 2, 32, 8, 80


def _metadata(tables: torch.Tensor, spans: list[tuple[int, int]]) -> AttentionMetadata:
    """Sequence i computes positions spans[i] = (first, end) over the context 0..end."""
    device = tables.device
    positions = torch.cat([torch.arange(a, b) for a, b in spans]).to(device)
    seq_of = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(spans)]).to(device)
    slots = tables[seq_of, positions // BLOCK].long() * BLOCK + positions % BLOCK
    query_lens = [b - a for a, b in spans]
    return AttentionMetadata(
        positions=positions.to(device), slot_mapping=slots.to(device),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).to(device),
        seq_lens=torch.tensor([b for _, b in spans], dtype=torch.int32, device=device),
        block_tables=tables, max_query_len=max(query_lens),
        max_seq_len=max(b for _, b in spans), tokens_per_block=BLOCK,
        query_lens_cpu=query_lens, seq_lens_cpu=[b for _, b in spans])


def _layouts(rng: random.Random) -> list[list[int]]:
    """Chunk ends of the probe: one prefill, decodes after a prefix, random chunks."""
    decodes = list(range(LENGTH - 12, LENGTH + 1))   # (each step a launch: CI time)
    chunks, end = [], 0
    while end < LENGTH:
        end = min(LENGTH, end + rng.choice((1, 3, 8, 17, 40)))
        chunks.append(end)
    return [[LENGTH], decodes, chunks, [16, 64, 65, LENGTH]]


def probe_outputs(backend, dtype, device, rng, sinks=None, num_blocks=160):
    """The probe's outputs [LENGTH, heads, dim] for each layout; other requests (decodes
    and prefill chunks, random data) share its steps, except in the first layout."""
    heads, kv_heads, dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(LENGTH, h, dim, generator=gen).to(dtype).to(device)
               for h in (heads, kv_heads, kv_heads))
    results = []
    for trial, ends in enumerate(_layouts(rng)):
        cache = tuple(torch.randn(num_blocks, BLOCK, kv_heads, dim, dtype=dtype, device=device)
                      for _ in range(2))
        blocks = torch.randperm(num_blocks).to(torch.int32).to(device)
        out, done = torch.empty(LENGTH, heads, dim, dtype=dtype, device=device), 0
        for end in ends:
            others = [] if trial == 0 else [
                (p, p + rng.choice((1, 1, 7, 30))) for p in
                (rng.randrange(0, 60) for _ in range(rng.randint(0, 4)))]
            at = rng.randint(0, len(others))
            spans = others[:at] + [(done, end)] + others[at:]
            # the probe keeps its own blocks (its earlier chunks' keys stay there)
            tables = [blocks[12 * i:12 * (i + 1)] for i in range(len(others))]
            meta = _metadata(torch.stack(tables[:at] + [blocks[-12:]] + tables[at:]), spans)
            rows = int(meta.query_start_loc[at])
            num_tokens = meta.positions.shape[0]
            step = [torch.randn(num_tokens, h, dim, dtype=dtype, device=device)
                    for h in (heads, kv_heads, kv_heads)]
            mine = slice(rows, rows + end - done)
            for x, probe in zip(step, (q, k, v)):
                x[mine] = probe[done:end]
            write_kv_cache(step[1], step[2], cache, meta.slot_mapping)
            out[done:end] = backend._attend_kernel(step[0], cache, meta, (1.0, 1.0),
                                                   sinks)[mine]
            done = end
        results.append(out)
    return results


@pytest.mark.parametrize("dtype,options", [
    (torch.float32, {}),
    (torch.float32, dict(sliding_window=40, logits_soft_cap=1.5)),
    (torch.float32, dict(attention_chunk_size=32)),
])   # (bf16 outputs round away most fp32 differences: the GPU test below runs bf16)
def test_a_token_is_the_same_bits_in_any_layout(device, dtype, options):
    backend = BatchInvariantAttentionBackend(HEADS, KV_HEADS, DIM, DIM ** -0.5, **options)
    sinks = torch.randn(HEADS, device=device) if "sliding_window" in options else None
    first, *others = probe_outputs(backend, dtype, device, random.Random(0), sinks)
    for i, out in enumerate(others):
        assert torch.equal(out, first), i


@pytest.mark.skipif(not CUDA, reason="the kernel is the CUDA path")
def test_the_backend_runs_the_kernel_on_cuda(monkeypatch):
    import tllm.kernels.triton.invariant_attention as kernel_module
    calls = []
    real = kernel_module.invariant_paged_attention
    monkeypatch.setattr(kernel_module, "invariant_paged_attention",
                        lambda *args, **kw: calls.append(1) or real(*args, **kw))
    batch = make_paged_batch([1, 9], [20, 4], HEADS, KV_HEADS, DIM, BLOCK, torch.bfloat16,
                             "cuda")
    backend = BatchInvariantAttentionBackend(HEADS, KV_HEADS, DIM, DIM ** -0.5)
    backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata)
    assert calls == [1]


@pytest.mark.skipif(not CUDA, reason="the compiled kernel runs on the GPU only")
def test_invariance_on_cuda_in_bf16():
    """(2) with the compiled kernel, at Llama 3.1 8B's head shape: its binary, not the
    interpreter, must keep rows apart."""
    for options in ({}, dict(sliding_window=24, logits_soft_cap=30.0)):
        backend = BatchInvariantAttentionBackend(32, 8, 128, 128 ** -0.5, **options)
        sinks = torch.randn(32, device="cuda") if options else None
        first, *others = probe_outputs(backend, torch.bfloat16, "cuda", random.Random(1),
                                       sinks)
        for i, out in enumerate(others):
            assert torch.equal(out, first), (options, i)
