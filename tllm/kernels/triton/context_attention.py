"""Paged context (prefill) attention: flash attention over variable-length queries flattened
across the batch, with keys and values read from the paged cache through block tables.

A request's queries are the last query_len positions of its seq_len-token context, so a cached
prefix (prefix reuse, chunked prefill) is attended like any other key, and a query_len of 1
(a decode request in a mixed batch) works too. One program owns BLOCK_M queries of one head;
the grid is flattened over the query tiles of all sequences (see _find_seq). An fp8 cache is
read as e4m3 and widened in registers: the key scale folds into the softmax scale and the
value scale into the output (real = fp8 * scale).
The reference is `paged_attention_ref` in attention_ref.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.attention_common import (attend_tile, check_paged_layout,
                                                  check_sinks, fold_sink, init_softmax_state,
                                                  soft_cap_args)
from tllm.kernels.triton.attention_ref import paged_attention_ref
from tllm.kernels.triton.launch import dot_block_d, dot_precision, needs_fp32_dot, next_pow2

__all__ = ["paged_context_attention", "paged_attention_ref"]


@triton.jit
def _find_seq(query_start_loc_ptr, slot, num_seqs, BLOCK_M: tl.constexpr):
    """The sequence owning grid slot `slot`: the last i with q_start[i] // BLOCK_M + i <= slot.
    Sequence i owns slots from q_start[i] // BLOCK_M + i on, at least one per BLOCK_M of its
    queries, so a grid of num_tokens // BLOCK_M + num_seqs slots covers every tile however
    the lengths mix (a B x max_tiles grid would be mostly idle for one long prefill among
    many single-token requests)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid <= slot:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The step's counts, its block tables' width and the request-indexed pointers (a mixed
# step's prefills start at request d: seq_lens + d) change every step. Triton would compile
# a variant for each new class of them (divisible by 16, equal to 1, 16-byte aligned or not)
# the first time it occurs: 1-2 s each, mid-serving (seen as 2 s TTFT stalls on an H200).
@triton.jit(do_not_specialize=["num_seqs", "stride_table"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr",
                                            "seq_lens_ptr"])
def _context_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr,
        seq_lens_ptr, sinks_ptr, qk_scale, soft_cap, window, chunk, num_seqs, k_scale, v_scale,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_ct, stride_ch, stride_table,
        GROUP: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
        SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr, CAUSAL: tl.constexpr = True,
        USE_CHUNK: tl.constexpr = False):
    head = tl.program_id(0)
    # Later causal tiles do more work: launch them first, so short ones fill the tail.
    slot = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, slot, num_seqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq)
    tile = slot - q_start // BLOCK_M - seq
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)  # attend_tile casts k, p and v to q's dtype
    if CAUSAL:
        q_pos = seq_len - q_len + offs_m
        first_pos = seq_len - q_len + tile * BLOCK_M
    else:  # every row sees the whole sequence: as a query at its last position would
        q_pos = seq_len - 1 + offs_m * 0
        first_pos = seq_len - 1
    qk_scale = qk_scale * k_scale  # q . (k * k_scale) = k_scale * (q . k)

    kv_head = head // GROUP
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    acc, l_i, m_i = init_softmax_state(BLOCK_M, BLOCK_D)

    # Keys before `mid` are visible to every row of the tile: no mask needed there. A
    # window or chunks (the first row's chunk starts the keys any row sees) mask all.
    if USE_WINDOW or USE_CHUNK:
        first_key = 0
        if USE_WINDOW:
            first_key = tl.maximum(first_pos - window + 1, 0)
        if USE_CHUNK:
            first_key = tl.maximum(first_key, first_pos // chunk * chunk)
        lo = first_key // BLOCK_N * BLOCK_N
        mid = lo
    else:
        lo = 0
        mid = first_pos // BLOCK_N * BLOCK_N
    hi = tl.minimum(seq_len, first_pos + BLOCK_M)
    for start_n in range(lo, mid, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, seq_len, window, chunk, qk_scale, soft_cap,
            k_base, v_base, table_ptr, stride_cb, stride_ct, TOKENS_PER_BLOCK, HEAD_DIM,
            BLOCK_D, BLOCK_N, False, USE_WINDOW, USE_CHUNK, PRECISION, SOFT_CAP)
    for start_n in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, seq_len, window, chunk, qk_scale, soft_cap,
            k_base, v_base, table_ptr, stride_cb, stride_ct, TOKENS_PER_BLOCK, HEAD_DIM,
            BLOCK_D, BLOCK_N, True, USE_WINDOW, USE_CHUNK, PRECISION, SOFT_CAP)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
        acc, l_i, m_i = fold_sink(acc, l_i, m_i, tl.full([BLOCK_M], 0.0, tl.float32) + sink)
    # Rows past the query end may see no key (under a window); they are not stored.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale  # exact for v_scale 1
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@dataclass(frozen=True)
class ContextConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def context_config(max_query_len: int, head_dim: int, element_size: int = 2) -> ContextConfig:
    """Tiles for H100/H200: 128x128 with 8 warps and 3 stages was the fastest on an H200 at
    head dim 128 for long queries (bench_attention --sweep, 2026-11-29: 1.1-1.3x over 128x64);
    short query batches (chunks, mixed decode) get a smaller BLOCK_M to waste less. 4-byte
    (fp32) tiles take twice the shared memory: 128x128 at head dim 128 asked 262,656 B of the
    H200's 232,448, so they get 64-row tiles and two stages."""
    block_d = next_pow2(head_dim)
    block_n = 64 if block_d <= 128 else 32
    wide = element_size >= 4
    if max_query_len <= 16:
        return ContextConfig(16, block_n, 4, 2 if wide and block_d >= 128 else 3)
    if max_query_len <= 64 or block_d > 128 or wide:
        return ContextConfig(64, block_n, 4, 3 if block_d <= 128 and not wide else 2)
    return ContextConfig(128, 128, 8, 3)


def paged_context_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, scale: float,
                            sliding_window: int | None = None,
                            out: torch.Tensor | None = None,
                            config: ContextConfig | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0,
                            logits_soft_cap: float | None = None,
                            sinks: torch.Tensor | None = None,
                            causal: bool = True,
                            attention_chunk_size: int | None = None) -> torch.Tensor:
    """q [T, Hq, D]; caches [num_blocks, tokens_per_block, Hkv, D]; returns [T, Hq, D].
    The keys and values of this step's tokens must already be in the cache. `config`
    overrides the tile sizes (for tuning); the scales are an fp8 cache's;
    `logits_soft_cap`: scores -> cap * tanh(scores / cap) before the mask (Gemma 2);
    `sinks`: [Hq] logits added to each head's softmax denominator (GPT-OSS);
    `causal` False: every query attends all its sequence's keys (encoders);
    `attention_chunk_size`: a query sees the keys of its own chunk only (Llama 4)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_paged_layout(q, k_cache, v_cache, out)
    check_sinks(sinks, num_heads)
    cfg = config or context_config(max_query_len, head_dim, q.element_size())
    grid = (num_heads, num_tokens // cfg.block_m + num_seqs)
    qk_scale, soft_cap = soft_cap_args(scale, logits_soft_cap)
    _context_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        q if sinks is None else sinks, qk_scale, soft_cap, sliding_window or 0,
        attention_chunk_size or 1, num_seqs,
        float(k_scale), float(v_scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, TOKENS_PER_BLOCK=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=dot_block_d(head_dim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        USE_WINDOW=sliding_window is not None, PRECISION=dot_precision(q.dtype),
        DOT_FP32=needs_fp32_dot(_context_attention_kernel, q.dtype),
        SOFT_CAP=logits_soft_cap is not None, HAS_SINKS=sinks is not None, CAUSAL=causal,
        USE_CHUNK=attention_chunk_size is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out

