"""Batch-invariant paged attention for deterministic mode on CUDA: a query row's output is
the same bits whichever step computes it (alone, among other requests, as a decode, inside
a prefill chunk of any length), in one launch per layer for the whole step.

What fixes the bits: one compiled configuration (BLOCK_M, BLOCK_N, warps: no autotune, no
split-K); a tile holds BLOCK_M query positions of one sequence aligned to absolute position
0, so a token always sits in the same row of its tile; keys are walked from position 0 in
BLOCK_N blocks, also aligned to 0, in order. Extra blocks a row walks because of its
tile-mates are fully masked for it, and a fully masked block is an exact no-op (the running
max stays, alpha = exp2(0) = 1, p = 0), as is skipping one. Each row of tl.dot depends only
on its own row. The reference is the torch path of BatchInvariantAttentionBackend
(tllm/attention/invariant.py)."""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tllm.kernels.triton.attention_common import (attend_tile, check_paged_layout, check_sinks,
                                                  fold_sink, init_softmax_state, soft_cap_args)
from tllm.kernels.triton.launch import dot_block_d, dot_precision, needs_fp32_dot

__all__ = ["invariant_paged_attention", "build_tiles", "BLOCK_M", "BLOCK_N"]

BLOCK_M = 16    # query positions per tile, for every launch
BLOCK_N = 64    # keys per block: tllm.attention.invariant.KEY_SPLIT
_NUM_WARPS = 4
_MAX_TILES = 65535  # grid axis 1
_MAX_HEAD_DIM = 256  # K and V tiles of 64 x 256 still fit shared memory


@triton.jit
def _first_key(first_pos, window, chunk, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
               USE_CHUNK: tl.constexpr):
    """The first key block any row at or after first_pos may see: the blocks before it are
    fully masked for the whole tile, so skipping them changes no bit."""
    lo = first_pos * 0
    if USE_WINDOW:
        lo = tl.maximum(lo, first_pos - window + 1)
    if USE_CHUNK:
        lo = tl.maximum(lo, first_pos // chunk * chunk)
    return lo // BLOCK_N * BLOCK_N


# Step-dependent counts and pointers are not specialized on: one binary for every step.
@triton.jit(do_not_specialize=["stride_table", "window", "chunk"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr",
                                            "seq_lens_ptr", "tiles_ptr"])
def _invariant_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr,
        seq_lens_ptr, tiles_ptr, sinks_ptr, qk_scale, soft_cap, window, chunk, k_scale,
        v_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch,
        stride_table,
        GROUP: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
        DOT_FP32: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    tile_pos = tl.load(tiles_ptr + 2 * tile + 1)   # a multiple of BLOCK_M
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(query_start_loc_ptr + seq)
    first_query = seq_len - (tl.load(query_start_loc_ptr + seq + 1) - q_start)

    offs_d = tl.arange(0, BLOCK_D)
    q_pos = tile_pos + tl.arange(0, BLOCK_M)
    is_row = (q_pos >= first_query) & (q_pos < seq_len)
    io_mask = is_row[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + q_pos - first_query).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)  # attend_tile casts k, p and v to q's dtype
    qk_scale = qk_scale * k_scale  # q . (k * k_scale) = k_scale * (q . k)

    kv_head = head // GROUP
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    acc, l_i, m_i = init_softmax_state(BLOCK_M, BLOCK_D)
    lo = _first_key(tl.maximum(tile_pos, first_query), window, chunk, BLOCK_N, USE_WINDOW,
                    USE_CHUNK)
    hi = tl.minimum(seq_len, tile_pos + BLOCK_M)
    for start_n in range(lo, hi, BLOCK_N):
        # always masked: a mask of all True leaves the scores as they are, so no row's bits
        # depend on whether its tile-mates needed one
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, seq_len, window, chunk, qk_scale, soft_cap,
            k_base, v_base, table_ptr, stride_cb, stride_ct, TOKENS_PER_BLOCK, HEAD_DIM,
            BLOCK_D, BLOCK_N, True, USE_WINDOW, USE_CHUNK, PRECISION, SOFT_CAP)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
        acc, l_i, m_i = fold_sink(acc, l_i, m_i, tl.full([BLOCK_M], 0.0, tl.float32) + sink)
    # padding rows may see no key; they are not stored
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale  # exact for v_scale 1
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def build_tiles(query_lens: list[int], seq_lens: list[int],
                device: torch.device | str) -> torch.Tensor:
    """The step's tile table, [num_tiles, 2] int32 (sequence, first position): each
    sequence's query positions cut at multiples of BLOCK_M, counted from position 0."""
    query = np.asarray(query_lens, dtype=np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    first = (seq - query) // BLOCK_M
    counts = np.where(query > 0, (seq - 1) // BLOCK_M - first + 1, 0)
    owner = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    tiles = np.stack([owner, (first[owner] + within) * BLOCK_M], axis=1).astype(np.int32)
    return torch.from_numpy(tiles).to(device, non_blocking=True)


def invariant_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                              seq_lens: torch.Tensor, tiles: torch.Tensor, scale: float,
                              sliding_window: int | None = None,
                              attention_chunk_size: int | None = None,
                              logits_soft_cap: float | None = None,
                              sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                              v_scale: float = 1.0,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over caches [num_blocks, tokens_per_block, Hkv, D]
    (this step's keys and values already written); returns [T, Hq, D]. `tiles`: build_tiles
    of the step; the scales are an fp8 cache's; `logits_soft_cap`: scores -> cap *
    tanh(scores / cap) before the mask; `sinks`: [Hq] logits in each head's denominator."""
    num_tokens, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or tiles.shape[0] == 0:
        return out
    check_paged_layout(q, k_cache, v_cache, out)
    check_sinks(sinks, num_heads)
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"deterministic attention on CUDA takes head_dim up to "
                         f"{_MAX_HEAD_DIM}, got {head_dim}")
    if tiles.shape[0] > _MAX_TILES:
        raise ValueError(f"{tiles.shape[0]} query tiles exceed the grid's {_MAX_TILES}; "
                         "schedule fewer tokens per step")
    block_d = dot_block_d(head_dim)
    qk_scale, soft_cap = soft_cap_args(scale, logits_soft_cap)
    _invariant_attention_kernel[(num_heads, tiles.shape[0])](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, tiles,
        q if sinks is None else sinks, qk_scale, soft_cap, sliding_window or 0,
        attention_chunk_size or 1, float(k_scale), float(v_scale), q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // k_cache.shape[2], TOKENS_PER_BLOCK=k_cache.shape[1],
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        USE_WINDOW=sliding_window is not None, USE_CHUNK=attention_chunk_size is not None,
        PRECISION=dot_precision(q.dtype),
        DOT_FP32=needs_fp32_dot(_invariant_attention_kernel, q.dtype),
        SOFT_CAP=logits_soft_cap is not None, HAS_SINKS=sinks is not None,
        num_warps=_NUM_WARPS, num_stages=_num_stages(block_d, q.element_size()))
    return out


def _num_stages(block_d: int, element_size: int) -> int:
    """K and V tiles of 64 x block_d per stage: two stages fit up to 512-byte rows (head
    dim 256 in bf16, 128 in fp32), one beyond. Fixed per model, so per layer's binary."""
    return 2 if block_d * element_size <= 512 else 1
