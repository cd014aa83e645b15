"""MLA decode attention in the absorbed form over the paged latent cache (DeepSeek-V2/V3).

Each cached token is one row of latent_dim + rope_dim values (kv_lora_rank latents after
kv_a_layernorm, then the rotated rope part of the key); the query of each head has the same
width (q_nope @ W_UK, then its rope part). Scores are q . row over the whole width; the
output is the softmax-weighted sum of the rows' latent parts ([heads, latent_dim]), which the
model takes through W_UV. One program serves a block of heads of one sequence, so each cache
tile is read once for all of them (every head shares the one latent "kv head"), with an
online softmax over tiles of BLOCK_N tokens. One query token per sequence (decode). When
sequences x head blocks are too few to fill the GPU (batch 1: one program), the context is
split into partitions whose partial results the decode kernel's merge kernel combines by
log-sum-exp (flash-decoding, as tllm.kernels.triton.decode_attention does).

`mla_decode_ref` beside it is the float32 reference: one sequence at a time, gathered rows,
an explicit softmax."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.decode_attention import (_merge_block, _merge_partitions_kernel,
                                                  _partial_buffers, choose_num_splits)
from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["stride_table", "stride_pt", "stride_ph", "stride_lt",
                               "stride_lh"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _mla_decode_kernel(
        out_ptr, part_out_ptr, part_lse_ptr, q_ptr, cache_ptr, block_tables_ptr,
        seq_lens_ptr, qk_scale, num_heads, partition, stride_qt, stride_qh, stride_ot,
        stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_cb,
        stride_ct, stride_table,
        LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        TOKENS_PER_BLOCK: tl.constexpr, IS_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
        DOT_FP32: tl.constexpr):
    seq = tl.program_id(0)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = split * partition
    if part_start >= seq_len:
        return
    part_end = tl.minimum(part_start + partition, seq_len)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    h_mask = offs_h < num_heads
    l_mask = offs_l < LATENT
    r_mask = offs_r < ROPE
    q_rows = q_ptr + seq.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_latent = tl.load(q_rows + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :],
                       other=0.0)
    q_rope = tl.load(q_rows + LATENT + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :],
                     other=0.0)
    if DOT_FP32:
        q_latent, q_rope = q_latent.to(tl.float32), q_rope.to(tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for start in range(part_start, part_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < part_end
        block = tl.load(table + offs_n // TOKENS_PER_BLOCK, mask=n_mask, other=0)
        rows = (cache_ptr + block.to(tl.int64) * stride_cb
                + (offs_n % TOKENS_PER_BLOCK) * stride_ct)
        latent = tl.load(rows[:, None] + offs_l[None, :],
                         mask=n_mask[:, None] & l_mask[None, :], other=0.0)
        rope = tl.load(rows[:, None] + LATENT + offs_r[None, :],
                       mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        latent, rope = latent.to(q_latent.dtype), rope.to(q_latent.dtype)
        scores = tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
        scores += tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION)
        scores = tl.where(n_mask[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent,
                                            input_precision=PRECISION)
        m_i = m_new
    has_keys = l_i > 0.0  # a padded graph row has none
    l_safe = tl.where(has_keys, l_i, 1.0)
    io_mask = h_mask[:, None] & l_mask[None, :]
    if IS_SPLIT:
        row = seq.to(tl.int64)
        tl.store(part_out_ptr + row * stride_pt + offs_h[:, None] * stride_ph
                 + split * stride_ps + offs_l[None, :], acc / l_safe[:, None], mask=io_mask)
        tl.store(part_lse_ptr + row * stride_lt + offs_h * stride_lh + split,
                 tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf")), mask=h_mask)
    else:
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
                 + offs_l[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
                 mask=io_mask)


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, latent_dim: int, scale: float,
                         max_seq_len: int | None = None, num_splits: int | None = None,
                         query_start_loc: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, block_n: int = 32,
                         block_h: int = 16) -> torch.Tensor:
    """q [seqs, heads, latent_dim + rope] (one query token per sequence); cache
    [blocks, tokens_per_block, 1, latent_dim + rope]; block_tables [seqs, max_blocks]
    int32; seq_lens [seqs] (this token included); max_seq_len: their bound (None: read from
    seq_lens, a host sync); query_start_loc: arange(seqs + 1) (None: made here). Returns
    [seqs, heads, latent_dim]."""
    num_seqs, num_heads, width = q.shape
    _check_args(q, cache, latent_dim)
    if out is None:
        out = q.new_empty(num_seqs, num_heads, latent_dim)
    if num_seqs == 0:
        return out
    head_blocks = triton.cdiv(num_heads, block_h)
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, head_blocks, max_seq_len, q.device)
    partition = cdiv(cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = cdiv(max_seq_len, partition)
    part_out, part_lse = _partial_buffers(out, num_splits)
    rope_dim = width - latent_dim
    _mla_decode_kernel[(num_seqs, head_blocks, num_splits)](
        out, part_out, part_lse, q, cache, block_tables, seq_lens, scale * _LOG2E, num_heads,
        partition, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
        part_lse.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
        LATENT=latent_dim, ROPE=rope_dim, BLOCK_L=max(16, next_pow2(latent_dim)),
        BLOCK_R=max(16, next_pow2(rope_dim)), BLOCK_H=block_h, BLOCK_N=block_n,
        TOKENS_PER_BLOCK=cache.shape[1], IS_SPLIT=num_splits > 1,
        PRECISION=dot_precision(q.dtype), DOT_FP32=needs_fp32_dot(_mla_decode_kernel, q.dtype))
    if num_splits > 1:
        if query_start_loc is None:
            query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)
        _merge_partitions_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, query_start_loc, seq_lens, seq_lens, partition,
            out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1),
            part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            HEAD_DIM=latent_dim, BLOCK_D=max(16, next_pow2(latent_dim)),
            BLOCK_S=_merge_block(num_splits), HAS_SINKS=False,  # (sinks_ptr unread)
            num_warps=4)
    return out


def _check_args(q: torch.Tensor, cache: torch.Tensor, latent_dim: int) -> None:
    width = q.shape[2]
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != width:
        raise ValueError(f"cache must be [blocks, tokens_per_block, 1, {width}], got "
                         f"{tuple(cache.shape)}")
    if not 0 < latent_dim < width:
        raise ValueError(f"latent_dim must be between 1 and {width - 1}, got {latent_dim}")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("q and cache must be contiguous in their last dim")


def mla_decode_ref(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, latent_dim: int, scale: float) -> torch.Tensor:
    """What mla_decode_attention computes, in float32, a sequence at a time."""
    tokens_per_block = cache.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=torch.float32,
                      device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, :-(-seq_len // tokens_per_block)].long()
        rows = cache[blocks].flatten(0, 1)[:seq_len, 0].float()     # [seq_len, width]
        probs = (q[i].float() @ rows.T * scale).softmax(dim=-1)      # [heads, seq_len]
        out[i] = probs @ rows[:, :latent_dim]
    return out
