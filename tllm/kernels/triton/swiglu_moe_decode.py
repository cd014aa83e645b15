"""GPT-OSS's experts for a decode step's few tokens, without the sort: the two launches of
tllm.kernels.triton.moe_decode (a program per (pair, n tile) for gate_up, per (token, n tile)
for down and the top-k sum) with swiglu_moe's epilogues (biases, the clamped SwiGLU) and
its weights: MXFP4 blocks dequantized from bits in a one-row GEMV (swiglu_moe._gemv_mxfp4),
or weights in the activations' dtype (moe_decode._rows_dot).

The tile path (swiglu_moe.swiglu_experts_triton) sorts the pairs (a launch of its own) even
at batch 1, where each tile holds one pair, and sums each token's pairs in a third launch;
here neither runs. Rounding as there: the intermediate once, each pair's weighted down row
once, the sum in fp32 in pair order.

Reference: tllm.kernels.swiglu_moe.swiglu_experts_ref."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.mxfp4 import BLOCK_SIZE
from tllm.kernels.triton.launch import cdiv, next_pow2
from tllm.kernels.triton.moe_decode import _rows_dot
from tllm.kernels.triton.moe_tiles import GemmTile
from tllm.kernels.triton.mxfp4_dots import MXFP4_MIN_BLOCK_K, _gemv_mxfp4

# UNTUNED (gate_up, down): swiglu_moe's one-row MXFP4 tile (_MXFP4_CONFIGS' first row), the
# down GEMV at 16 rows a program so that one token's 2880 outputs still make 180 programs
# (32 rows: 90, fewer than an H100's 132 SMs); the dense GEMV's defaults for weights in the
# activations' dtype
MXFP4_TILES = (GemmTile(32, 256, 4, 3), GemmTile(16, 256, 4, 3))
PLAIN_TILES = (GemmTile(4, 1024, 4, 2), GemmTile(4, 1024, 4, 2))


@triton.jit
def _expert_row_dot(a_base, w_ptr, scales_ptr, expert, rows, stride_we, stride_wn, stride_se,
                    stride_sn, K, MXFP4: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """[1, BLOCK_N] fp32: a row (a_base: [1, 1] pointer to its first column) against weight
    rows `rows` of `expert`: MXFP4 words and scales, or weights in a's dtype."""
    if MXFP4:
        w_words = (w_ptr + expert * stride_we + rows[:, None] * stride_wn).to(
            tl.pointer_type(tl.int32))
        s_rows = scales_ptr + expert * stride_se + rows[:, None] * stride_sn
        out = _gemv_mxfp4(a_base, w_words, s_rows, K, tl.full([1], 1, tl.int1), BLOCK_N,
                          BLOCK_K)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
        # SCALES 0 (moe_decode.NO_SCALES): the weights as they are
        out = _rows_dot(a_base + offs_k[None, :], w_ptrs, w_ptrs, 0, offs_k, K, BLOCK_N,
                        BLOCK_K, 0, 1, EVEN_K, 1)
    return out


@triton.jit
def _pair_swiglu_kernel(inter_ptr, a_ptr, w_ptr, scales_ptr, bias_ptr, ids_ptr, expert_start,
                        N, K, alpha, limit, stride_am, stride_we, stride_wn, stride_se,
                        stride_sn, stride_bias, stride_i, NUM_EXPERTS: tl.constexpr,
                        TOP_K: tl.constexpr, MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """inter[pair, n tile] = clamped_swiglu(x W_gate^T + b_gate, x W_up^T + b_up) for
    x = a[pair // TOP_K] and the pair's expert (gate rows n, up rows N + n)."""
    pair = tl.program_id(0).to(tl.int64)
    local = tl.load(ids_ptr + pair).to(tl.int32) - expert_start
    if (local < 0) | (local >= NUM_EXPERTS):
        return  # another rank's expert: the down kernel skips this pair
    expert = local.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)  # rows past N are computed, not stored
    a_base = a_ptr + (pair // TOP_K) * stride_am + tl.zeros([1, 1], dtype=tl.int64)
    gate = _expert_row_dot(a_base, w_ptr, scales_ptr, expert, rows, stride_we, stride_wn,
                           stride_se, stride_sn, K, MXFP4, BLOCK_N, BLOCK_K, EVEN_K)
    up = _expert_row_dot(a_base, w_ptr, scales_ptr, expert, N + rows, stride_we, stride_wn,
                         stride_se, stride_sn, K, MXFP4, BLOCK_N, BLOCK_K, EVEN_K)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + expert * stride_bias + rows).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + expert * stride_bias + N + rows).to(tl.float32)[None, :]
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    out = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    tl.store(inter_ptr + pair * stride_i + offs_n[None, :],
             out.to(inter_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])


@triton.jit
def _token_down_kernel(out_ptr, inter_ptr, w_ptr, scales_ptr, bias_ptr, ids_ptr,
                       topk_weights_ptr, expert_start, N, K, stride_o, stride_i, stride_we,
                       stride_wn, stride_se, stride_sn, stride_bias,
                       NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, MXFP4: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr):
    """out[token, n tile] = sum over the token's local pairs of
    round((inter[pair] W2^T + b2) * weight), in fp32, pair order."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        local = tl.load(ids_ptr + pair).to(tl.int32) - expert_start
        if (local >= 0) & (local < NUM_EXPERTS):
            expert = local.to(tl.int64)
            a_base = inter_ptr + pair * stride_i + tl.zeros([1, 1], dtype=tl.int64)
            y = _expert_row_dot(a_base, w_ptr, scales_ptr, expert, rows, stride_we,
                                stride_wn, stride_se, stride_sn, K, MXFP4, BLOCK_N, BLOCK_K,
                                EVEN_K)
            if HAS_BIAS:
                y += tl.load(bias_ptr + expert * stride_bias + rows).to(tl.float32)[None, :]
            weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
            acc += (y * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_o + offs_n[None, :], acc.to(dtype),
             mask=(offs_n < N)[None, :])


def _weight_args(w: torch.Tensor, scales: torch.Tensor | None, k: int,
                 tile: GemmTile) -> tuple[torch.Tensor, tuple[int, int], int, bool]:
    """(the scales to pass, their strides, BLOCK_K, EVEN_K) for w's kind."""
    if scales is None:
        block_k = min(tile.block_k, next_pow2(k))
        return w, (0, 0), block_k, k % block_k == 0
    if w.data_ptr() % 4:
        raise ValueError("MXFP4 blocks must start on a 4-byte boundary (read as int32)")
    return scales, (scales.stride(0), scales.stride(1)), max(tile.block_k, MXFP4_MIN_BLOCK_K), True


def swiglu_decode_experts(hidden: torch.Tensor, w13: torch.Tensor, w13_bias: torch.Tensor,
                          w2: torch.Tensor, w2_bias: torch.Tensor | None,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, alpha: float,
                          limit: float, expert_start: int = 0,
                          w13_scales: torch.Tensor | None = None,
                          w2_scales: torch.Tensor | None = None) -> torch.Tensor:
    """swiglu_moe.swiglu_experts_triton's arguments (checked there) on the sort-free path."""
    num_tokens, top_k = topk_ids.shape
    mxfp4 = w13_scales is not None
    num_experts, hidden_size = w2.shape[0], w2.shape[1]
    inter_size = w13.shape[1] // 2
    tile, down_tile = MXFP4_TILES if mxfp4 else PLAIN_TILES
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0:
        return out
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    x = hidden.contiguous()
    inter = torch.empty(num_tokens * top_k, inter_size, dtype=hidden.dtype,
                        device=hidden.device)
    k13 = w13.shape[2] * (BLOCK_SIZE if mxfp4 else 1)
    scales, strides, block_k, even_k = _weight_args(w13, w13_scales, k13, tile)
    _pair_swiglu_kernel[(num_tokens * top_k, cdiv(inter_size, tile.block_n))](
        inter, x, w13, scales, w13_bias, ids, expert_start, inter_size, k13, float(alpha),
        float(limit), x.stride(0), w13.stride(0), w13.stride(1), *strides,
        w13_bias.stride(0), inter.stride(0), NUM_EXPERTS=num_experts, TOP_K=top_k,
        MXFP4=mxfp4, HAS_BIAS=True, BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_K=even_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    tile = down_tile
    scales, strides, block_k, even_k = _weight_args(w2, w2_scales, inter_size, tile)
    bias = w2 if w2_bias is None else w2_bias  # unread without a bias
    _token_down_kernel[(num_tokens, cdiv(hidden_size, tile.block_n))](
        out, inter, w2, scales, bias, ids, topk_weights.float().contiguous(), expert_start,
        hidden_size, inter_size, out.stride(0), inter.stride(0), w2.stride(0), w2.stride(1),
        *strides, bias.stride(0), NUM_EXPERTS=num_experts, TOP_K=top_k, MXFP4=mxfp4,
        HAS_BIAS=w2_bias is not None, BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_K=even_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out
