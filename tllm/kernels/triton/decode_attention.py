"""Paged decode attention: a few query tokens per request (1 for decode, up to 8 for
speculative verification: the last token and its drafts, causal among themselves) against a
long paged context.

Two ideas carry the speed. XQA: one program serves all query heads that share a KV head, so
each KV tile is read from memory once; its query tile is [group x queries, head_dim], padded
to 16 rows for tl.dot. Flash-decoding: when batch x kv-heads is too small to fill the GPU, the
context is split into partitions handled by separate programs, and a second kernel merges their
partial results by log-sum-exp. Sequences of any length share one launch: a partition past a
sequence's end returns at once. An fp8 cache is read as e4m3 and widened in registers: the
key scale folds into the softmax scale and the value scale into the output (real = fp8 *
scale). The reference is `paged_attention_ref` in attention_ref.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.attention_common import (attend_tile, check_paged_layout,
                                                  check_sinks, fold_sink, init_softmax_state,
                                                  soft_cap_args)
from tllm.kernels.triton.attention_ref import paged_attention_ref
from tllm.kernels.triton.launch import (cdiv, dot_block_d, dot_precision, needs_fp32_dot,
                                        next_pow2, num_sms)

__all__ = ["paged_decode_attention", "paged_attention_ref", "choose_num_splits"]

MAX_DECODE_QUERIES = 8  # rows of a tile: GQA group x queries (32 at Llama's group of 4)
_MIN_PARTITION = 256      # tokens; shorter partitions cost more in merging than they save
_MAX_SPLITS = 64
_WAVES = 4                # programs per SM to aim for: enough loads in flight for HBM


# As the context kernel: what changes every step is not specialized on (eager mixed steps
# pass request-offset tables and lengths), so no compile lands mid-serving. The partial
# buffers' strides follow the split count (the LSE's row stride is heads x splits: divisible
# by 16 or not as the count changes), so they are not specialized on either.
_PARTIAL_STRIDES = ["stride_pt", "stride_ph", "stride_lt", "stride_lh"]


@triton.jit(do_not_specialize=["stride_table", *_PARTIAL_STRIDES],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr",
                                            "seq_lens_ptr"])
def _decode_attention_kernel(
        out_ptr, part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
        query_start_loc_ptr, seq_lens_ptr, sinks_ptr, qk_scale, soft_cap, window, chunk,
        partition,
        k_scale, v_scale, stride_qt, stride_qh, stride_ot, stride_oh,
        stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_cb, stride_ct, stride_ch,
        stride_table,
        GROUP: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr, IS_SPLIT: tl.constexpr,
        PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, SOFT_CAP: tl.constexpr,
        HAS_SINKS: tl.constexpr):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = split * partition
    if part_start >= seq_len:
        return
    part_end = tl.minimum(part_start + partition, seq_len)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start

    # Row r of the tile is query token r // GROUP of this sequence, head kv_head*GROUP + r%GROUP.
    offs_r = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    token = offs_r // GROUP
    rows = (q_start + token).to(tl.int64)
    heads = kv_head * GROUP + offs_r % GROUP
    io_mask = (token < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=io_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)  # attend_tile casts k, p and v to q's dtype
    q_pos = seq_len - q_len + token
    qk_scale = qk_scale * k_scale  # q . (k * k_scale) = k_scale * (q . k)

    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    acc, l_i, m_i = init_softmax_state(BLOCK_H, BLOCK_D)

    # Keys before `mid` are visible to every query row and inside the sequence: no mask.
    # A window or chunks (the first query's chunk starts the keys any row sees) mask all.
    if USE_WINDOW or USE_CHUNK:
        first_key = 0
        if USE_WINDOW:
            first_key = tl.maximum(seq_len - q_len - window + 1, 0)
        if USE_CHUNK:
            first_key = tl.maximum(first_key, (seq_len - q_len) // chunk * chunk)
        lo = tl.maximum(part_start, first_key // BLOCK_N * BLOCK_N)
        mid = lo
    else:
        lo = part_start
        visible_end = tl.minimum(part_end, seq_len - q_len + 1)
        mid = lo + tl.maximum(visible_end - lo, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, mid, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, part_end, window, chunk, qk_scale, soft_cap,
            k_base, v_base, table_ptr, stride_cb, stride_ct, TOKENS_PER_BLOCK, HEAD_DIM,
            BLOCK_D, BLOCK_N, False, USE_WINDOW, USE_CHUNK, PRECISION, SOFT_CAP)
    for start_n in range(mid, part_end, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pos, start_n, part_end, window, chunk, qk_scale, soft_cap,
            k_base, v_base, table_ptr, stride_cb, stride_ct, TOKENS_PER_BLOCK, HEAD_DIM,
            BLOCK_D, BLOCK_N, True, USE_WINDOW, USE_CHUNK, PRECISION, SOFT_CAP)

    if IS_SPLIT:
        # A partition may hold no key a row can see (a window, an earlier draft token):
        # it contributes weight 0 through lse = -inf, and a finite partial output.
        has_keys = l_i > 0.0
        l_safe = tl.where(has_keys, l_i, 1.0)
        lse = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
        part = acc / l_safe[:, None] * v_scale  # exact for v_scale 1
        tl.store(part_out_ptr + rows[:, None] * stride_pt + heads[:, None] * stride_ph
                 + split * stride_ps + offs_d[None, :], part, mask=io_mask)
        tl.store(part_lse_ptr + rows * stride_lt + heads * stride_lh + split, lse,
                 mask=token < q_len)
    else:
        if HAS_SINKS:  # a split launch adds the sinks where it merges the partitions
            sink = tl.load(sinks_ptr + heads).to(tl.float32) * 1.4426950408889634  # log2(e)
            acc, l_i, m_i = fold_sink(acc, l_i, m_i, sink)
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :],
                 (acc / l_i[:, None] * v_scale).to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=_PARTIAL_STRIDES,
            do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr"])
def _merge_partitions_kernel(
        out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, seq_lens_ptr, sinks_ptr,
        partition, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
        HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    num_parts = tl.cdiv(tl.load(seq_lens_ptr + seq), partition)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_parts
    d_mask = offs_d < HEAD_DIM
    if HAS_SINKS:  # the sink joins as one more partition with no output
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
    else:
        sink = float("-inf")
    for t in range(0, q_len):
        row = (q_start + t).to(tl.int64)
        lse = tl.load(part_lse_ptr + row * stride_lt + head * stride_lh + offs_s,
                      mask=s_mask, other=float("-inf"))
        top = tl.maximum(tl.max(lse, 0), sink)
        weight = tl.math.exp2(lse - top)
        part = tl.load(part_out_ptr + row * stride_pt + head * stride_ph
                       + offs_s[:, None] * stride_ps + offs_d[None, :],
                       mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        out = tl.sum(part * weight[:, None], 0) / (tl.sum(weight, 0) + tl.math.exp2(sink - top))
        tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d,
                 out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _merge_block(num_splits: int) -> int:
    """Two tile sizes, not one per power of two: each is a compile, and eager steps meet new
    split counts as their contexts grow."""
    return 16 if num_splits <= 16 else next_pow2(max(num_splits, _MAX_SPLITS))


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int, element_size: int = 2) -> DecodeConfig:
    """64-token tiles keep K and V for three pipeline stages in ~100 KB of shared memory at
    head dim 128, two programs an SM: enough bytes in flight to saturate HBM. 4-byte (fp32)
    tiles take twice that: two stages (~130 KB) stay well inside the H200's 227 KB."""
    if next_pow2(head_dim) > 128:
        return DecodeConfig(32, 4, 2)
    return DecodeConfig(64, 4, 2 if element_size >= 4 else 3)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device) -> int:
    """Partitions per sequence: enough programs for a few waves over the SMs, but none
    shorter than _MIN_PARTITION tokens."""
    programs = num_seqs * num_kv_heads
    wanted = cdiv(_WAVES * num_sms(device), programs)
    return max(1, min(wanted, cdiv(max_seq_len, _MIN_PARTITION), _MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           max_query_len: int = 1, sliding_window: int | None = None,
                           num_splits: int | None = None,
                           out: torch.Tensor | None = None,
                           config: DecodeConfig | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0,
                           logits_soft_cap: float | None = None,
                           sinks: torch.Tensor | None = None,
                           attention_chunk_size: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] holding 1..MAX_DECODE_QUERIES tokens per sequence; returns [T, Hq, D].
    The keys and values of this step's tokens must already be in the cache. `config`
    overrides the tile size and pipelining (for tuning); the scales are an fp8 cache's;
    `logits_soft_cap`: scores -> cap * tanh(scores / cap) before the mask (Gemma 2);
    `sinks`: [Hq] logits added to each head's softmax denominator (GPT-OSS);
    `attention_chunk_size`: a query sees the keys of its own chunk only (Llama 4)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    if max_query_len > MAX_DECODE_QUERIES:
        raise ValueError(f"decode attention takes at most {MAX_DECODE_QUERIES} queries per "
                         f"sequence, got {max_query_len}")
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_paged_layout(q, k_cache, v_cache, out)
    check_sinks(sinks, num_heads)
    sinks_arg = q if sinks is None else sinks  # an unread pointer without sinks
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    cfg = config or decode_config(head_dim, q.element_size())
    partition = cdiv(cdiv(max_seq_len, num_splits), cfg.block_n) * cfg.block_n
    num_splits = cdiv(max_seq_len, partition)
    group = num_heads // num_kv_heads
    is_split = num_splits > 1
    part_out, part_lse = _partial_buffers(q, num_splits)
    qk_scale, soft_cap = soft_cap_args(scale, logits_soft_cap)
    _decode_attention_kernel[(num_kv_heads, num_seqs, num_splits)](
        out, part_out, part_lse, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        sinks_arg, qk_scale, soft_cap, sliding_window or 0, attention_chunk_size or 1,
        partition, float(k_scale),
        float(v_scale), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, TOKENS_PER_BLOCK=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=dot_block_d(head_dim), BLOCK_H=max(16, next_pow2(group * max_query_len)),
        BLOCK_N=cfg.block_n, USE_WINDOW=sliding_window is not None,
        USE_CHUNK=attention_chunk_size is not None, IS_SPLIT=is_split,
        PRECISION=dot_precision(q.dtype),
        DOT_FP32=needs_fp32_dot(_decode_attention_kernel, q.dtype),
        SOFT_CAP=logits_soft_cap is not None, HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if is_split:
        _merge_partitions_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, query_start_loc, seq_lens, sinks_arg, partition,
            out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1),
            part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=dot_block_d(head_dim), BLOCK_S=_merge_block(num_splits),
            HAS_SINKS=sinks is not None, num_warps=4)
    return out


def _partial_buffers(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    if num_splits == 1:  # the kernel writes the output directly; these are never touched
        return (torch.empty(1, 1, 1, 1, device=q.device), torch.empty(1, 1, 1, device=q.device))
    part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                           device=q.device)
    return part_out, part_lse
