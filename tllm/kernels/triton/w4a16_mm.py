"""The weight-only dot kernel for 2 <= M < a few hundred rows (decode batches): the weight
tile is the left operand. out^T [N, M] = W [N, K] x^T: each program dequantizes a K tile of
BLOCK_N weight rows in registers (field j of the interleaved words is a [BLOCK_N, KW] tile
of (q - z), exact in bf16/fp16) and tl.dot-s it with the matching [KW, BLOCK_M] slice of
x^T. With the weight as the M side of the MMA, a 16-row batch fills the MMA's narrow N side
(8 / 16 wide) instead of padding a 64-row M side, the dequantized tile needs no trip
through shared memory, and each weight tile is read once for all the batch's rows (M tiles
of one N tile are neighbours in the grid, so a second M tile finds it in L2). Split-K fills
the SMs when N / BLOCK_N tiles alone cannot; partials are summed by the last split
(w4a16_gemv.split_store). Layout: tllm.kernels.woq."""
from __future__ import annotations

import triton
import triton.language as tl

from tllm.kernels.triton.w4a16_gemv import _field_minus_zero, split_store


@triton.jit
def _field_pairs(words, z, J: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr,
                 DTYPE: tl.constexpr, AS_FP32: tl.constexpr):
    """4-bit fields J and J + 4 of words [BLOCK_N, KW] minus the rows' zeros z: a
    [BLOCK_N, 2 * KW] tile in DTYPE (bf16 / fp16; exact), columns KW * h + w holding field
    J + 4h of word w (K in order: x^T's rows J*KW .. and (J+4)*KW ..). One mask-and-or makes
    both 16-bit halves of a word B + q (B = 128 in bf16, 1024 in fp16: unit 1), a packed
    subtract takes the zero: ~4.8 SASS instructions a weight at BLOCK_N 64 against ~8.3 for
    the fp32 field at a time. AS_FP32 (the interpreter, whose bf16 is integers): the
    subtraction in fp32."""
    BIAS: tl.constexpr = 0x43004300 if DTYPE == tl.bfloat16 else 0x64006400
    B: tl.constexpr = 128.0 if DTYPE == tl.bfloat16 else 1024.0
    r = ((words >> (4 * J)) & 0x000F000F) | BIAS
    pair = tl.join(r.to(tl.int16), (r >> 16).to(tl.int16)).to(DTYPE, bitcast=True)
    pair = tl.reshape(tl.permute(pair, (0, 2, 1)), [BLOCK_N, 2 * KW])
    if AS_FP32:
        return pair.to(tl.float32) - (z + B)[:, None]
    return pair - (z + B).to(DTYPE)[:, None]


@triton.jit
def _mm_wx_kernel(out_ptr, part_ptr, count_ptr, x_ptr, qw_ptr, s_ptr, z_ptr, M, N,
                  tiles_per_split, num_tiles, stride_xm, stride_qn, stride_sg, stride_ps,
                  BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, KW: tl.constexpr, IS_SPLIT: tl.constexpr,
                  DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, PAIRS: tl.constexpr):
    """Program (n tile, m tile: m fastest; k split) over its share of the K tiles (one
    interleave chunk each). out is [M, N] contiguous; partials [SPLIT, M, N] (stride_ps = M * N)."""
    PACK: tl.constexpr = 32 // BITS
    CHUNK: tl.constexpr = KW * PACK
    HI: tl.constexpr = 23 // BITS
    CHUNK_SCALED: tl.constexpr = GROUP % CHUNK == 0
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = (offs_m % M).to(tl.int64)      # padding columns re-read real rows: no mask
    rows_n = offs_n % N
    offs_w = tl.arange(0, KW)
    w_ptrs = qw_ptr + rows_n.to(tl.int64)[:, None] * stride_qn + offs_w[None, :]
    xt_ptrs = x_ptr + rows_m[None, :] * stride_xm + offs_w[:, None]       # [KW, BLOCK_M]
    t_lo = pid_k * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, num_tiles)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # PAIRS: fields j and j + 4 of the words a tile (16-bit math; 4 bits, whole-chunk groups)
    h = tl.arange(0, 2 * KW)
    xt_pair_ptrs = x_ptr + rows_m[None, :] * stride_xm + ((h // KW) * 4 * KW + h % KW)[:, None]
    for t in range(t_lo, t_hi):
        k0 = t * CHUNK
        words = tl.load(w_ptrs + t * KW)
        high = words >> (HI * BITS)
        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if PAIRS:
            z = tl.load(z_ptr + (k0 // GROUP) * stride_sg + rows_n).to(tl.float32)
            for j in tl.static_range(4):
                w = _field_pairs(words, z, j, BLOCK_N, KW, x_ptr.dtype.element_ty, DOT_FP32)
                xt = tl.load(xt_pair_ptrs + k0 + j * KW)
                if DOT_FP32:
                    xt = xt.to(tl.float32)
                part = tl.dot(w, xt, part, input_precision=PRECISION)
        for j in tl.static_range(PACK if not PAIRS else 0):
            g = (k0 + j * KW) // GROUP
            z = tl.load(z_ptr + g * stride_sg + rows_n).to(tl.float32)
            w = _field_minus_zero(words, high, z[:, None], j, BITS)
            if not CHUNK_SCALED:
                w = w * tl.load(s_ptr + g * stride_sg + rows_n).to(tl.float32)[:, None]
            xt = tl.load(xt_ptrs + k0 + j * KW)
            if DOT_FP32:
                xt = xt.to(tl.float32)
            part = tl.dot(w.to(xt.dtype), xt, part, input_precision=PRECISION)
        if CHUNK_SCALED:
            part = part * tl.load(s_ptr + (k0 // GROUP) * stride_sg + rows_n).to(
                tl.float32)[:, None]
        acc += part
    offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    split_store(out_ptr, part_ptr, count_ptr, acc, offs, mask, pid, pid_k, stride_ps,
                tl.num_programs(1), IS_SPLIT)
