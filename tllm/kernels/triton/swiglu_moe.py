"""GPT-OSS's experts in Triton: the grouped GEMMs of fused_moe.py (the same sort of (token,
expert) pairs by expert, the same top-k sum) with biases and the clamped SwiGLU as the GEMMs'
epilogues, the weights in the model's dtype or MXFP4 blocks read as packed FP4 codes and
E8M0 scales and dequantized in registers (a decode step reads 4.25 bits a weight):

  1. gate_up: [P, I] = clamped_swiglu(x W_gate^T + b_gate, x W_up^T + b_up), W13's gate rows
     then its up rows (as the model loads them);
  2. down: [P, H] = (act W2^T + b2) * routing weight;
  3. each token's top-k rows summed in fp32.

MXFP4 tiles are dequantized in registers by tllm.kernels.triton.mxfp4_dots (from bits, or by
tl.dot_scaled: MXFP4_DOTS); a tile of one row (block_m 1, batch-1 decode) skips tl.dot
(_gemv_mxfp4). MXFP4's own tile table is _MXFP4_CONFIGS. A decode step whose pairs rarely
share an expert skips the sort and the top-k sum: tllm.kernels.triton.swiglu_moe_decode.

Reference: tllm.kernels.swiglu_moe.swiglu_experts_ref (over dequantize_mxfp4)."""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from tllm.kernels.mxfp4 import BLOCK_SIZE, check_mxfp4
from tllm.kernels.triton.fused_moe import align_pairs, moe_config, sum_top_k
from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot
from tllm.kernels.triton.moe_decode import use_decode_path
from tllm.kernels.triton.moe_tiles import GemmTile, MoeConfig, config_by_load
from tllm.kernels.triton.mxfp4_dots import (MXFP4_MIN_BLOCK_K, _dot_mxfp4, _dot_mxfp4_scaled,
                                            _gemv_mxfp4)
from tllm.kernels.triton.swiglu_moe_decode import swiglu_decode_experts


@triton.jit
def _dot_plain(acc, a_base, w_base, k0, K, is_pair, BLOCK_K: tl.constexpr,
               DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc += x[:, k0:k0+BLOCK_K] . W[n, k0:k0+BLOCK_K]^T, W in the model's dtype."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    a = tl.load(a_base + offs_k[None, :], mask=is_pair[:, None] & k_ok[None, :], other=0.0)
    w = tl.load(w_base + offs_k[:, None], mask=k_ok[:, None], other=0.0)
    if DOT_FP32:
        a, w = a.to(tl.float32), w.to(tl.float32)
    return tl.dot(a, w, acc, input_precision=PRECISION)


@triton.jit
def _tile_products(a_base, w_base, w_words, s_rows, up_words, up_scales, K, is_pair,
                   GATED: tl.constexpr, MXFP4: tl.constexpr, SCALED_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """The K loop of tl.dots: (x W^T, x W_up^T if GATED) for a tile, fp32 [BLOCK_M, BLOCK_N];
    the up rows are up_words bytes and up_scales scales past the gate rows."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if SCALED_DOT:
            acc = _dot_mxfp4_scaled(acc, a_base, w_base, s_rows, k0, K, is_pair, BLOCK_K)
            if GATED:
                acc_up = _dot_mxfp4_scaled(acc_up, a_base, w_base + up_words,
                                           s_rows + up_scales, k0, K, is_pair, BLOCK_K)
        elif MXFP4:
            acc = _dot_mxfp4(acc, a_base, w_words, s_rows, k0, K, is_pair, BLOCK_K, DOT_FP32,
                             PRECISION)
            if GATED:
                acc_up = _dot_mxfp4(acc_up, a_base, w_words + up_words // 4,
                                    s_rows + up_scales, k0, K, is_pair, BLOCK_K, DOT_FP32,
                                    PRECISION)
        else:
            acc = _dot_plain(acc, a_base, w_base, k0, K, is_pair, BLOCK_K, DOT_FP32,
                             PRECISION)
            if GATED:
                acc_up = _dot_plain(acc_up, a_base, w_base + up_words, k0, K, is_pair,
                                    BLOCK_K, DOT_FP32, PRECISION)
    return acc, acc_up


@triton.jit
def _swiglu_expert_gemm_kernel(
        out_ptr, a_ptr, w_ptr, scales_ptr, bias_ptr, sorted_ptr, block_expert_ptr,
        num_padded_ptr, topk_weights_ptr, N, K, num_pairs, num_tiles_m, alpha, limit,
        stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_bias, stride_om,
        ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        MXFP4: tl.constexpr, SCALED_DOT: tl.constexpr, GEMV: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """out[pair, n] for the pairs of one sorted tile (fused_moe's _expert_gemm_kernel, with
    plain or MXFP4 weights (w_ptr: their bytes; SCALED_DOT: by tl.dot_scaled; GEMV: one row
    a tile, no tl.dot), a bias, and GPT-OSS's activation when GATED)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last tile in use: the host only knows a bound
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % N).to(tl.int64)                  # rows past N computed, not stored
    a_base = a_ptr + (pairs // ROWS_PER_A).to(tl.int64)[:, None] * stride_am
    w_base = w_ptr + expert * stride_we + rows_n[None, :] * stride_wn
    w_words = (w_ptr + expert * stride_we + rows_n[:, None] * stride_wn).to(
        tl.pointer_type(tl.int32))                      # MXFP4 rows: 16-byte aligned
    s_rows = scales_ptr + expert * stride_se + rows_n[:, None] * stride_sn
    bias_base = bias_ptr + expert * stride_bias + rows_n
    up_words, up_scales = N * stride_wn, N * stride_sn   # offsets of the up rows
    if GEMV:
        acc = _gemv_mxfp4(a_base, w_words, s_rows, K, is_pair, BLOCK_N, BLOCK_K)
        acc_up = acc
        if GATED:
            acc_up = _gemv_mxfp4(a_base, w_words + up_words // 4, s_rows + up_scales, K,
                                 is_pair, BLOCK_N, BLOCK_K)
    else:
        acc, acc_up = _tile_products(a_base, w_base, w_words, s_rows, up_words, up_scales, K,
                                     is_pair, GATED, MXFP4, SCALED_DOT, BLOCK_M, BLOCK_N,
                                     BLOCK_K, DOT_FP32, PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_base).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_base + N).to(tl.float32)[None, :]
    if GATED:
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=is_pair, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty),
             mask=is_pair[:, None] & (offs_n < N)[None, :])


# How a K tile of MXFP4 weights meets the activations: "bits" dequantizes in registers
# (_dot_mxfp4: integer ops, exact, any activation dtype); "scaled" hands the codes and scales
# to tl.dot_scaled (bf16 activations only), Triton's own upcast. Which is faster on a GPU is
# benchmarks/gpu_mxfp4_moe.py's question; "bits" is the default.
MXFP4_DOTS = ("bits", "scaled")

# MXFP4 tiles by the average pairs an expert gets, where they differ from moe_config's
# (bf16-tuned); past the last row moe_config's, with BLOCK_K at least MXFP4_MIN_BLOCK_K.
# UNTUNED: chosen without a GPU, by the SASS count of benchmarks/mxfp4_sass_count.py. A K
# step of MXFP4 carries a quarter of bf16's bytes, so decode takes BLOCK_K 256 to keep as
# many bytes in flight, and narrow N tiles so the dequantization spreads over every SM. At
# one pair an expert (batch-1 decode) block_m 1: a GEMV per pair (_gemv_mxfp4, ~10 SASS
# instructions a weight against the 16-row dots' ~12-14, of which 15 rows are padding).
# Larger M tiles amortize the dequantization over their rows and keep the bf16 tiles. To
# tune: the sweep of benchmarks/gpu_mxfp4_moe.py.
_MXFP4_CONFIGS = (
    (1, MoeConfig(1, GemmTile(32, 256, 4, 3), GemmTile(32, 256, 4, 3))),
    (8, MoeConfig(16, GemmTile(32, 256, 4, 3), GemmTile(64, 256, 4, 3))),
)


def mxfp4_moe_config(num_tokens: int, top_k: int, num_experts: int,
                     mxfp4_dot: str = "bits") -> MoeConfig:
    """The tile configuration of an MXFP4 step (_MXFP4_CONFIGS, then moe_config); "scaled"
    has no GEMV: 16-row tiles there."""
    bf16_tiles = moe_config(num_tokens, top_k, num_experts)
    cfg = config_by_load(_MXFP4_CONFIGS + ((float("inf"), bf16_tiles),), num_tokens, top_k,
                         num_experts)
    return replace(cfg, block_m=16) if cfg.block_m == 1 and mxfp4_dot == "scaled" else cfg


def _is_scaled_dot(mxfp4_dot: str, dtype: torch.dtype) -> bool:
    if mxfp4_dot not in MXFP4_DOTS:
        raise ValueError(f"mxfp4_dot must be one of {MXFP4_DOTS}, got {mxfp4_dot!r}")
    if mxfp4_dot == "scaled" and dtype != torch.bfloat16:
        raise ValueError(f"mxfp4_dot 'scaled' needs bf16 activations, got {dtype}")
    return mxfp4_dot == "scaled"


def swiglu_expert_gemm(a: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None,
                       bias: torch.Tensor | None, pairs, tile: GemmTile, group_m: int = 1,
                       rows_per_a: int = 1, gated: bool = False, alpha: float = 1.0,
                       limit: float = 0.0, topk_weights: torch.Tensor | None = None,
                       mxfp4_dot: str = "bits") -> torch.Tensor:
    """One grouped GEMM over the sorted `pairs` (fused_moe.PairBlocks): a [P / rows_per_a,
    K]; w [E, rows, K] in a's dtype, or with `scales` MXFP4 blocks [E, rows, K / 32, 16]
    and scales [E, rows, K / 32]; bias [E, rows] or None; rows = 2N (gate, then up) if
    gated, else N -> [P, N] in a's dtype. mxfp4_dot: see MXFP4_DOTS."""
    scaled_dot = scales is not None and _is_scaled_dot(mxfp4_dot, a.dtype)
    block_k = tile.block_k
    if scales is not None:
        if w.data_ptr() % 4:
            raise ValueError("MXFP4 blocks must start on a 4-byte boundary (read as int32)")
        block_k = max(block_k, MXFP4_MIN_BLOCK_K)
    gemv = pairs.block_m == 1
    if gemv and (scales is None or scaled_dot):
        raise ValueError("block_m 1 (a GEMV per pair) is for MXFP4 weights by 'bits' only")
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2] * BLOCK_SIZE if scales is not None else w.shape[2]
    out = torch.empty(pairs.num_pairs, n, dtype=a.dtype, device=a.device)
    if pairs.num_pairs == 0 or n == 0:
        return out
    weights = topk_weights.reshape(-1) if topk_weights is not None else pairs.num_padded
    scale_arg = w if scales is None else scales  # unread without MXFP4
    bias_arg = w if bias is None else bias
    grid = (pairs.max_blocks * cdiv(n, tile.block_n),)
    _swiglu_expert_gemm_kernel[grid](
        out, a, w, scale_arg, bias_arg, pairs.sorted_pairs, pairs.block_expert,
        pairs.num_padded, weights, n, k, pairs.num_pairs, pairs.max_blocks, float(alpha),
        float(limit), a.stride(0), w.stride(0), w.stride(1), scale_arg.stride(0),
        scale_arg.stride(1), bias_arg.stride(0), out.stride(0), ROWS_PER_A=rows_per_a,
        GATED=gated, MUL_WEIGHT=topk_weights is not None, MXFP4=scales is not None,
        SCALED_DOT=scaled_dot, GEMV=gemv, HAS_BIAS=bias is not None, BLOCK_M=pairs.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=block_k, GROUP_M=group_m,
        DOT_FP32=needs_fp32_dot(_swiglu_expert_gemm_kernel, a.dtype),
        PRECISION=dot_precision(a.dtype), num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    return out


def swiglu_experts_triton(hidden: torch.Tensor, w13: torch.Tensor, w13_bias: torch.Tensor,
                          w2: torch.Tensor, w2_bias: torch.Tensor | None,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, alpha: float,
                          limit: float, expert_start: int = 0,
                          w13_scales: torch.Tensor | None = None,
                          w2_scales: torch.Tensor | None = None,
                          config: MoeConfig | None = None,
                          mxfp4_dot: str = "bits", decode: bool | None = None) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] in hidden's
    dtype, or with the scales MXFP4 blocks [E, 2I, H/32, 16] and [E, H, I/32, 16]; biases
    [E, 2I] and [E, H] (w2_bias None: not added, as on all tensor-parallel ranks but one);
    topk_* [T, k] (global ids; this rank holds experts expert_start .. + E - 1). Returns
    [T, H] in hidden's dtype. MXFP4 weights take mxfp4_moe_config's tiles by default and
    `mxfp4_dot`'s dequantization (MXFP4_DOTS). `decode`: the sort-free path of
    tllm.kernels.triton.swiglu_moe_decode (None: where moe_decode.use_decode_path says,
    unless a tile config or the "scaled" dot is asked for)."""
    k13 = w13.shape[2] * (BLOCK_SIZE if w13_scales is not None else 1)
    if hidden.dim() != 2 or hidden.shape[1] != k13:
        raise ValueError(f"hidden must be [tokens, {k13}], got {tuple(hidden.shape)}")
    for blocks, scales in ((w13, w13_scales), (w2, w2_scales)):
        if scales is not None:
            check_mxfp4(blocks, scales)
        elif blocks.dtype != hidden.dtype:
            raise ValueError(f"expert weights are {blocks.dtype}; hidden is {hidden.dtype}")
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    if decode is None:  # (one GEMM in MXFP4 and the other not: the tile path has it)
        decode = (config is None and mxfp4_dot == "bits"
                  and (w13_scales is None) == (w2_scales is None)
                  and use_decode_path(num_tokens, top_k, num_experts))
    if decode:
        return swiglu_decode_experts(hidden, w13, w13_bias, w2, w2_bias, topk_weights,
                                     topk_ids, alpha, limit, expert_start, w13_scales,
                                     w2_scales)
    if w13_scales is not None and w2_scales is not None:
        _is_scaled_dot(mxfp4_dot, hidden.dtype)  # checked before any launch
        cfg = config or mxfp4_moe_config(num_tokens, top_k, num_experts, mxfp4_dot)
    else:
        cfg = config or moe_config(num_tokens, top_k, num_experts)
    pairs = align_pairs(topk_ids, num_experts, cfg.block_m, expert_start)
    inter = swiglu_expert_gemm(hidden.contiguous(), w13, w13_scales, w13_bias, pairs,
                               cfg.gate_up, cfg.group_m, rows_per_a=top_k, gated=True,
                               alpha=alpha, limit=limit, mxfp4_dot=mxfp4_dot)
    pair_out = swiglu_expert_gemm(inter, w2, w2_scales, w2_bias, pairs, cfg.down, cfg.group_m,
                                  topk_weights=topk_weights.float().contiguous(),
                                  mxfp4_dot=mxfp4_dot)
    return sum_top_k(pair_out, topk_ids, num_experts, expert_start)
