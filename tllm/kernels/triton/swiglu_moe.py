"""GPT-OSS's experts in Triton: the grouped GEMMs of fused_moe.py (the same sort of (token,
expert) pairs by expert, the same top-k sum) with biases and the clamped SwiGLU as the GEMMs'
epilogues, the weights in the model's dtype or MXFP4 blocks read as packed FP4 codes and
E8M0 scales and dequantized in registers (a decode step reads 4.25 bits a weight):

  1. gate_up: [P, I] = clamped_swiglu(x W_gate^T + b_gate, x W_up^T + b_up), W13's gate rows
     then its up rows (as the model loads them);
  2. down: [P, H] = (act W2^T + b2) * routing weight;
  3. each token's top-k rows summed in fp32.

A byte holds the codes of reduction columns 2j (low nibble) and 2j + 1 (high nibble), so an
int32 word holds columns 8w .. 8w + 7 (nibble i: column 8w + i), all under one scale. A K
tile is read as words [BLOCK_N, BLOCK_K / 8] and is 8 dots, nibble i's weights against
columns 8w + i of x. Each weight is built as float32 bits from its code and its block's
scale with a handful of integer ops (_e2m1_times_scale: no exp2, no float math; the scale's
part once per word), then cast to the activations' dtype; FP4 codes times powers of two are
exact in bf16, so the dequantized tile equals the reference decoder's (tllm.kernels.mxfp4)
before the dot, for every scale a checkpoint uses (_scale_bits). tl.dot_scaled is the
alternative (MXFP4_DOTS). A tile of one row (block_m 1, batch-1 decode) skips tl.dot: its
weights stay float32 and meet x in FMAs (_gemv_mxfp4). MXFP4's own tile table is
_MXFP4_CONFIGS. SASS instructions per weight of the K loop, for sm_90 without a GPU:
benchmarks/mxfp4_sass_count.py.

Reference: tllm.kernels.swiglu_moe.swiglu_experts_ref (over dequantize_mxfp4)."""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from tllm.kernels.mxfp4 import BLOCK_SIZE, check_mxfp4
from tllm.kernels.triton.fused_moe import (GemmTile, MoeConfig, align_pairs, config_by_load,
                                           moe_config, sum_top_k)
from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot
from tllm.kernels.triton.moe_decode import use_decode_path


@triton.jit
def _e2m1_times_scale(words, shift: tl.constexpr, exponent_bits, code_mask):
    """The e2m1 codes at bits shift .. shift + 3 of `words` (int32) times their scale, as
    float32 bits built with integer ops (no exp2, no float math). A code is sign bit 3,
    exponent e bits 2-1 (bias 1), mantissa m bit 0, e == 0 subnormal (0 or 0.5). A normal
    code's float32 exponent field is e + 126 plus the scale's scale - 127, its mantissa bit
    22 is m: (e << 1 | m) << 22 added to `exponent_bits` = (126 + scale - 127) << 23. Code 1
    (0.5 = 2^-1) is exponent_bits itself and code 0 is 0: exponent_bits times the code.
    exponent_bits and `code_mask` (7, or 0 to flush the block) come from _scale_bits."""
    magnitude = (words >> shift) & code_mask               # e << 1 | m
    bits = tl.where(magnitude >= 2, (magnitude << 22) + exponent_bits,
                    magnitude * exponent_bits)
    return (bits | ((words << (28 - shift)) & -(1 << 31))).to(tl.float32, bitcast=True)


@triton.jit
def _scale_bits(scale):
    """An E8M0 scale byte -> (exponent_bits, code_mask) for _e2m1_times_scale, once per
    block. The scale is clamped to the range where every code's exponent stays in 1 .. 254
    (no wrap, no float32 subnormal): scales 2 .. 252 are exact; 0 and 1 (the whole block
    below 2^-123) flush the block to zero; 253 .. 255 (2^126 and up, never a checkpoint's)
    saturate at 2^125 where ldexp gives larger values or inf."""
    offset = scale.to(tl.int32) - 127
    return (126 + tl.minimum(offset, 125)) << 23, tl.where(offset < -125, 0, 7)


@triton.jit
def _mxfp4_words(w_words, s_rows, k0, K, BLOCK_K: tl.constexpr):
    """One K tile's words [BLOCK_N, BLOCK_K / 8] and their scales' (exponent_bits,
    code_mask) (_scale_bits); zero codes past K."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    w_ok = offs_w < K // 8
    words = tl.load(w_words + offs_w[None, :], mask=w_ok[None, :], other=0)
    exponent_bits, code_mask = _scale_bits(tl.load(s_rows + (offs_w // 4)[None, :],
                                               mask=w_ok[None, :], other=127))
    return words, exponent_bits, code_mask


@triton.jit
def _dot_mxfp4(acc, a_base, w_words, s_rows, k0, K, is_pair,
               BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc += x[:, k0:k0+BLOCK_K] . W[n, k0:k0+BLOCK_K]^T for one tile of rows (a_base) and
    weight rows (w_words: their int32 words as a column [BLOCK_N, 1]; s_rows: their scales,
    likewise), dequantized from bits. Word w holds the codes of columns 8w .. 8w + 7 (nibble
    i: column 8w + i) under one scale, so a K tile is 8 dots, nibble i's [BLOCK_N, BLOCK_K/8]
    against columns 8w + i of x, and the scale's part is made once per 8 weights."""
    words, exponent_bits, code_mask = _mxfp4_words(w_words, s_rows, k0, K, BLOCK_K)
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)          # word columns
    a_cols = a_base + 8 * offs_w[None, :]
    a_mask = is_pair[:, None] & (offs_w < K // 8)[None, :]
    for i in tl.static_range(8):
        w = _e2m1_times_scale(words, 4 * i, exponent_bits, code_mask)
        a = tl.load(a_cols + i, mask=a_mask, other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
        else:
            w = w.to(a.dtype)  # exact: an FP4 value times a power of two fits any float type
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemv_mxfp4(a_base, w_words, s_rows, K, is_pair, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """x . W[n, :]^T for a tile of one row (BLOCK_M 1) -> [1, BLOCK_N], without tl.dot: the
    weights stay float32 and meet x in one FMA each, into per-lane sums [BLOCK_N,
    BLOCK_K / 8] summed once at the end. The next K tile's words are loaded before this
    one is used (the pipeliner stages only loads that feed a dot)."""
    partial = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    offs_w = tl.arange(0, BLOCK_K // 8)
    words, exponent_bits, code_mask = _mxfp4_words(w_words, s_rows, 0, K, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        next_words, next_bits, next_mask = _mxfp4_words(w_words, s_rows, k0 + BLOCK_K, K,
                                                        BLOCK_K)
        a_cols = a_base + k0 + 8 * offs_w[None, :]
        a_mask = is_pair[:, None] & (k0 + 8 * offs_w < K)[None, :]
        for i in tl.static_range(8):
            a = tl.load(a_cols + i, mask=a_mask, other=0.0).to(tl.float32)
            partial += a * _e2m1_times_scale(words, 4 * i, exponent_bits, code_mask)
        words, exponent_bits, code_mask = next_words, next_bits, next_mask
    return tl.sum(partial, 1)[None, :]


@triton.jit
def _dot_mxfp4_scaled(acc, a_base, w_base, s_rows, k0, K, is_pair, BLOCK_K: tl.constexpr):
    """_dot_mxfp4 by tl.dot_scaled (bf16 activations): Triton's own e2m1 upcast and scale
    multiply (on Hopper, bf16 MMAs after it). s_rows: the weight rows' scale pointers as a
    column [BLOCK_N, 1]."""
    offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_base + offs_j[:, None], mask=(offs_j < K // 2)[:, None], other=0)
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scale = tl.load(s_rows + offs_g[None, :], mask=(offs_g < K // 32)[None, :], other=127)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_base + offs_k[None, :], mask=is_pair[:, None] & (offs_k < K)[None, :],
                other=0.0)
    return tl.dot_scaled(a, None, "bf16", packed, scale, "e2m1", acc, fast_math=True)


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


# _dot_mxfp4's 8 dots a K step each need 16 columns (tl.dot's least K)
MXFP4_MIN_BLOCK_K = 128


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
        from tllm.kernels.triton.swiglu_moe_decode import swiglu_decode_experts  # imports us
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
