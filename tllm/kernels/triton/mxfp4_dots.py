"""MXFP4 weight tiles dequantized in registers, for the expert GEMMs of
tllm.kernels.triton.swiglu_moe and swiglu_moe_decode (GPT-OSS).

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
swiglu_moe._MXFP4_CONFIGS. SASS instructions per weight of the K loop, for sm_90 without a GPU:
benchmarks/mxfp4_sass_count.py.

Reference: tllm.kernels.mxfp4.dequantize_mxfp4."""
from __future__ import annotations

import triton
import triton.language as tl

# _dot_mxfp4's 8 dots a K step each need 16 columns (tl.dot's least K)
MXFP4_MIN_BLOCK_K = 128


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
