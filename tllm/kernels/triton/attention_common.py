"""The step shared by the paged context and decode kernels: read a tile of keys and values
through a block table and fold it into the online (flash-attention) softmax.

Scores are kept in the log2 domain (the softmax scale is pre-multiplied by log2(e)) so the
kernels use exp2, which maps to one hardware instruction."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)


@triton.jit
def attend_tile(acc, l_i, m_i, q, q_pos, start_n, seq_len, window, chunk, qk_scale, soft_cap,
                k_base, v_base, table_ptr, stride_block, stride_token,
                TOKENS_PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, USE_WINDOW: tl.constexpr,
                USE_CHUNK: tl.constexpr, PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Folds keys [start_n, start_n + BLOCK_N) into the running (acc, l_i, m_i) of the rows of
    q, whose positions are q_pos. MASKED applies the causal/length/window mask (and with
    USE_CHUNK Llama 4's chunked local attention: keys of the query's own `chunk`); tiles
    wholly visible to every row skip it. SOFT_CAP: scores are soft_cap * tanh(q.k * qk_scale) (the
    wrapper passes qk_scale = scale / cap and soft_cap = cap * log2(e), see soft_cap_args)."""
    pos = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_seq = pos < seq_len
    # A tile may span several cache blocks: each token finds its block through the table, so
    # the tile size is free of the cache's block size (16-token tiles starve tensor cores).
    block = tl.load(table_ptr + pos // TOKENS_PER_BLOCK, mask=in_seq, other=0).to(tl.int64)
    offs = (block[:, None] * stride_block + (pos % TOKENS_PER_BLOCK)[:, None] * stride_token
            + offs_d[None, :])
    if HEAD_DIM == BLOCK_D:  # a mask constant along D keeps the loads vectorised
        kv_mask = in_seq[:, None]
    else:
        kv_mask = in_seq[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_base + offs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    if SOFT_CAP:  # before the mask, as HF's Gemma 2 does
        s = soft_cap * tanh(s)
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & in_seq[None, :]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        if USE_CHUNK:  # (with pos <= q_pos: the key's chunk is the query's) a division a row
            visible = visible & (pos[None, :] >= (q_pos // chunk * chunk)[:, None])
        s = tl.where(visible, s, float("-inf"))
    # m_i starts finite (see init_softmax_state), so a fully masked row gives exp2(-inf) = 0
    # rather than exp2(-inf - -inf) = NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + offs, mask=kv_mask, other=0.0)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def tanh(x):
    """tanh through exp2 (the interpreter has no libdevice): exp2(-2|x| log2 e) lies in
    (0, 1], so nothing overflows, and tanh is odd."""
    t = tl.math.exp2(-2.8853900817779268 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


def soft_cap_args(scale: float, logits_soft_cap: float | None) -> tuple[float, float]:
    """(qk_scale, soft_cap) kernel arguments: scores in the log2 domain, soft-capped or not."""
    if logits_soft_cap is None:
        return scale * LOG2E, 1.0
    return scale / logits_soft_cap, logits_soft_cap * LOG2E


@triton.jit
def fold_sink(acc, l_i, m_i, sink):
    """Folds a sink (a logit in the log2 domain that attends to no value: GPT-OSS's learned
    per-head sink) into the running softmax: it only adds exp2(sink) to the denominator."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.math.exp2(m_i - m_new)
    return acc * alpha[:, None], l_i * alpha + tl.math.exp2(sink - m_new), m_new


@triton.jit
def init_softmax_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    return acc, l_i, m_i


def check_paged_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       out: torch.Tensor) -> None:
    """The kernels take strides for all but the head dimension, and one set for both caches."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dimension must be contiguous")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k_cache.shape[2]} "
                         "kv heads")


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    if sinks is not None and (sinks.shape != (num_heads,) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a float tensor of [{num_heads}] (one logit per query "
                         f"head), got {sinks.dtype} {tuple(sinks.shape)}")
