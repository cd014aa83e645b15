"""Weight-only int4 / int8 GEMMs in Triton (W4A16, W8A16): out [M, N] = x [M, K] times a
weight kept in tllm.kernels.woq's packed form (qweight int32 [N, K / pack], scales and zeros
[K / group, N]), dequantized in registers.

Values are unpacked without a shift or an int-to-float conversion (a slow instruction): the
layout interleaves each chunk of K so that one bit-field of a row of words is a contiguous
run of K; a field inside the float mantissa is masked in place and OR-ed into 2^23, which
reads as 2^23 + q * 2^(4j), and one fused multiply-add by a power of two takes it to q - z
exactly. The group scale is applied to a whole K tile's partial sum where the group spans
the tile, not to each weight, so the per-weight work is mask-and-or, multiply-add,
multiply-add (SASS for sm_90 checked on the CPU with triton.compile: no shuffles, 16-byte
weight loads, ~5.5 instructions a weight in the GEMV loop).

Three paths, by the number of rows M:
- M = 1 (batch-1 decode), `_gemv_kernel`: CUDA cores, no tensor-core tile of which 15/16
  would be padding. A program streams BLOCK_N weight rows along K (whole 16-byte runs of
  each row) and accumulates elementwise, reducing once at the end.
- 2 <= M < DEQUANT_MIN_ROWS, `_mm_kernel`: tl.dot tiles of (q - z) in the activation dtype
  (exact: small integers), the scale applied to each tile's product. Small M takes one
  16-row M tile and splits K when N alone cannot fill the SMs (split-K); larger M tiles M
  and N (the tiled path) in grouped order so column tiles are reused from L2.
- M >= DEQUANT_MIN_ROWS (prefill): compute bound; the weight is dequantized once into a
  [N, K] buffer (`_dequant_kernel`) and multiplied by cuBLAS, as vLLM does for AWQ.
Split-K partial sums are added by a second kernel in a fixed order (deterministic).

Reference: tllm.kernels.woq.woq_mm_ref / dequantize."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tllm.kernels.triton.fp8_gemm import _sum_splits_kernel
from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot, next_pow2, num_sms
from tllm.kernels.woq import WoqLayout

DEQUANT_MIN_ROWS = 256     # from here a dequantized weight and cuBLAS (compute bound)
_MIN_TILES_PER_SPLIT = 4   # K tiles (chunks): shorter splits cost more in partial sums than they gain


@dataclass(frozen=True)
class WoqConfig:
    """Launch shape; the K tile is always one interleave chunk of the weight's layout."""
    block_m: int       # 1: the GEMV kernel
    block_n: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _field_minus_zero(words, high, z, J: tl.constexpr, BITS: tl.constexpr):
    """Bit-field J of a tile of words [BN, KW] minus the rows' zero points z [BN]: float32
    q - z, exactly. A field inside the 23-bit mantissa is masked in place, others from `high`
    (words >> HI * BITS); the masked bits OR-ed into 2^23 read as 2^23 + q * UNIT, so one
    fused multiply-add by 1 / UNIT (a power of two) leaves q - z."""
    HI: tl.constexpr = 23 // BITS
    POS: tl.constexpr = J if J < HI else J - HI
    FIELD: tl.constexpr = ((1 << BITS) - 1) << (BITS * POS)
    INV_UNIT: tl.constexpr = 1.0 / (1 << (BITS * POS))
    src = words if J < HI else high
    biased = ((src & FIELD) | 0x4B000000).to(tl.float32, bitcast=True)
    return biased * INV_UNIT - (8388608.0 * INV_UNIT + z)[:, None]


@triton.jit
def _gemv_kernel(out_ptr, part_ptr, x_ptr, qw_ptr, s_ptr, z_ptr, N, tiles_per_split,
                 num_tiles, stride_qn, stride_sg, stride_ps,
                 BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 KW: tl.constexpr, IS_SPLIT: tl.constexpr):
    """M = 1. Program (n tile, k split): BLOCK_N rows over its share of the K tiles (one
    interleave chunk, KW words a row, each): field j of the tile meets x[k0 + j*KW ...]."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = KW * PACK
    HI: tl.constexpr = 23 // BITS
    TILE_SCALED: tl.constexpr = GROUP % BLOCK_K == 0   # else a scale per field
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N                       # rows past N are computed and not stored
    offs_w = tl.arange(0, KW)
    w_ptrs = qw_ptr + rows.to(tl.int64)[:, None] * stride_qn + offs_w[None, :]
    t_lo = pid_k * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, num_tiles)
    acc = tl.zeros([BLOCK_N, KW], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        k0 = t * BLOCK_K
        words = tl.load(w_ptrs + t * KW, eviction_policy="evict_first")
        high = words >> (HI * BITS)
        inner = tl.zeros([BLOCK_N, KW], dtype=tl.float32)
        for j in tl.static_range(PACK):
            g = (k0 + j * KW) // GROUP
            if TILE_SCALED:
                g = k0 // GROUP
            z = tl.load(z_ptr + g * stride_sg + rows).to(tl.float32)
            xj = tl.load(x_ptr + k0 + j * KW + offs_w).to(tl.float32)
            prod = _field_minus_zero(words, high, z, j, BITS) * xj[None, :]
            if TILE_SCALED:
                inner += prod
            else:
                inner += prod * tl.load(s_ptr + g * stride_sg + rows).to(tl.float32)[:, None]
        if TILE_SCALED:
            inner = inner * tl.load(s_ptr + (k0 // GROUP) * stride_sg + rows).to(
                tl.float32)[:, None]
        acc += inner
    out = tl.sum(acc, axis=1)
    mask = offs_n < N
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_n, out, mask=mask)
    else:
        tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mm_kernel(out_ptr, part_ptr, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, tiles_per_split,
               num_tiles, stride_xm, stride_om, stride_qn, stride_sg, stride_ps, stride_pm,
               BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, KW: tl.constexpr, GROUP_M: tl.constexpr,
               IS_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Program (m, n tile in grouped order; k split): each field of a K tile is a
    [KW, BLOCK_N] operand of (q - z) in the activation dtype (exact: small integers) for
    one tl.dot with the matching KW columns of x; the tile's product is scaled by its
    group's scales (or each field by its own, when a group is shorter than the tile)."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = KW * PACK
    HI: tl.constexpr = 23 // BITS
    TILE_SCALED: tl.constexpr = GROUP % BLOCK_K == 0
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = (offs_m % M).to(tl.int64)     # padding rows re-read real ones: no mask
    rows_n = offs_n % N
    offs_w = tl.arange(0, KW)
    x_base = x_ptr + rows_m[:, None] * stride_xm + offs_w[None, :]
    w_ptrs = qw_ptr + rows_n.to(tl.int64)[:, None] * stride_qn + offs_w[None, :]
    t_lo = pid_k * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, num_tiles)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        k0 = t * BLOCK_K
        words = tl.load(w_ptrs + t * KW)
        high = words >> (HI * BITS)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(PACK):
            g = (k0 + j * KW) // GROUP
            if TILE_SCALED:
                g = k0 // GROUP
            z = tl.load(z_ptr + g * stride_sg + rows_n).to(tl.float32)
            qz = _field_minus_zero(words, high, z, j, BITS)
            if not TILE_SCALED:
                qz = qz * tl.load(s_ptr + g * stride_sg + rows_n).to(tl.float32)[:, None]
            xj = tl.load(x_base + k0 + j * KW)
            if DOT_FP32:
                xj = xj.to(tl.float32)
            part = tl.dot(xj, tl.trans(qz.to(xj.dtype)), part, input_precision=PRECISION)
        if TILE_SCALED:
            part = part * tl.load(s_ptr + (k0 // GROUP) * stride_sg + rows_n).to(
                tl.float32)[None, :]
        acc += part
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :],
                 acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, qw_ptr, s_ptr, z_ptr, N, stride_wn, stride_qn, stride_sg,
                    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    KW: tl.constexpr):
    """One K tile (chunk) of BLOCK_N rows of the dequantized weight w [N, K] in w's dtype:
    ((q - z) * s) rounded once."""
    PACK: tl.constexpr = 32 // BITS
    HI: tl.constexpr = 23 // BITS
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    k0 = t * KW * PACK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N
    offs_w = tl.arange(0, KW)
    words = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * stride_qn + t * KW + offs_w[None, :])
    high = words >> (HI * BITS)
    out_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_w[None, :]
    for j in tl.static_range(PACK):
        g = (k0 + j * KW) // GROUP
        z = tl.load(z_ptr + g * stride_sg + rows).to(tl.float32)
        s = tl.load(s_ptr + g * stride_sg + rows).to(tl.float32)
        w = _field_minus_zero(words, high, z, j, BITS) * s[:, None]
        tl.store(out_ptrs + k0 + j * KW, w.to(w_ptr.dtype.element_ty),
                 mask=(offs_n < N)[:, None])


# ---- configurations ----

def default_config(m: int, n: int, k: int, layout: WoqLayout,
                   device: torch.device) -> WoqConfig:
    """M = 1: 128 rows a program (4 a thread, so each activation value loaded serves four
    weight rows), K split until the programs fill the SMs twice over. Small M: one 16-row
    dot tile, split-K alike. Larger M: 64/128-row tiles."""
    sms = num_sms(device)
    if m == 1:
        return _with_split(WoqConfig(1, min(128, max(16, next_pow2(n))), num_warps=4,
                                     num_stages=4), n, k, layout, sms)
    if m <= 16:
        return _with_split(WoqConfig(16, 64, num_warps=4, num_stages=4), n, k, layout, sms)
    if m <= 64:
        return _with_split(WoqConfig(64, 64, num_warps=4, num_stages=4), n, k, layout, sms,
                           tiles_m=cdiv(m, 64))
    return WoqConfig(128, 128, num_warps=8, num_stages=3)


def _with_split(cfg: WoqConfig, n: int, k: int, layout: WoqLayout, sms: int,
                tiles_m: int = 1) -> WoqConfig:
    tiles = cdiv(n, cfg.block_n) * tiles_m
    if tiles >= 2 * sms:
        return cfg
    iters = k // layout.chunk
    split = max(1, min(cdiv(2 * sms, tiles), iters // _MIN_TILES_PER_SPLIT))
    return WoqConfig(cfg.block_m, cfg.block_n, split, cfg.group_m, cfg.num_warps,
                     cfg.num_stages)


# ---- wrappers ----

def woq_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           layout: WoqLayout, config: WoqConfig | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, rows contiguous) times the packed weight -> [M, N] in x's
    dtype. Without an explicit config, M >= DEQUANT_MIN_ROWS (and M > 1 where the chunks are
    narrower than a 16-deep dot) dequantizes, then cuBLAS."""
    m, k = x.shape
    n = qweight.shape[0]
    _check(x, qweight, scales, zeros, layout)
    if config is None and (m >= DEQUANT_MIN_ROWS or (m > 1 and layout.chunk_words < 16)):
        return F.linear(x, woq_dequantize(qweight, scales, zeros, layout, x.dtype))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(m, n, k, layout, x.device)
    if cfg.block_m == 1 and m > 1:
        raise ValueError("the GEMV config (block_m 1) takes one row")
    if cfg.block_m > 1 and layout.chunk_words < 16:
        raise ValueError("the dot kernel needs chunks of 16 words")
    num_tiles = k // layout.chunk
    per_split = cdiv(num_tiles, cfg.split_k)
    num_splits = cdiv(num_tiles, per_split)
    part = (torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
            if num_splits > 1 else out)
    ps = part.stride(0) if num_splits > 1 else 0
    common = dict(BITS=layout.bits, GROUP=layout.group, BLOCK_N=cfg.block_n,
                  KW=layout.chunk_words, IS_SPLIT=num_splits > 1, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    if cfg.block_m == 1:
        _gemv_kernel[(cdiv(n, cfg.block_n), num_splits)](
            out, part, x, qweight, scales, zeros, n, per_split, num_tiles, qweight.stride(0),
            scales.stride(0), ps, **common)
    else:
        grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), num_splits)
        _mm_kernel[grid](
            out, part, x, qweight, scales, zeros, m, n, per_split, num_tiles, x.stride(0),
            out.stride(0), qweight.stride(0), scales.stride(0), ps,
            part.stride(1) if num_splits > 1 else 0, BLOCK_M=cfg.block_m, GROUP_M=cfg.group_m,
            DOT_FP32=needs_fp32_dot(_mm_kernel, x.dtype), PRECISION=dot_precision(x.dtype),
            **common)
    if num_splits > 1:
        block_cols = min(1024, next_pow2(n))
        _sum_splits_kernel[(m, cdiv(n, block_cols))](
            out, part, n, num_splits, out.stride(0), part.stride(0), part.stride(1),
            BLOCK=block_cols, num_warps=4)
    return out


def woq_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   layout: WoqLayout, dtype: torch.dtype) -> torch.Tensor:
    """The packed weight -> [N, K] in `dtype` (((q - z) * s) rounded once)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * layout.pack
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    _dequant_kernel[(cdiv(n, 64), k // layout.chunk)](
        w, qweight, scales, zeros, n, w.stride(0), qweight.stride(0), scales.stride(0),
        BITS=layout.bits, GROUP=layout.group, BLOCK_N=64, KW=layout.chunk_words, num_warps=4)
    return w


def _check(x, qweight, scales, zeros, layout: WoqLayout) -> None:
    m, k = x.shape
    if qweight.dtype != torch.int32 or qweight.shape[1] * layout.pack != k:
        raise ValueError(f"woq GEMM: x {tuple(x.shape)} and qweight {tuple(qweight.shape)} "
                         f"({qweight.dtype}) do not multiply at {layout.bits} bits")
    if k % layout.group or layout.group % 16 or k % layout.chunk:
        raise ValueError(f"woq GEMM: group {layout.group} must be a multiple of 16 dividing "
                         f"K = {k}, and K a multiple of the chunk ({layout.chunk})")
    groups = (k // layout.group, qweight.shape[0])
    if tuple(scales.shape) != groups or tuple(zeros.shape) != groups:
        raise ValueError(f"woq GEMM: scales {tuple(scales.shape)} / zeros "
                         f"{tuple(zeros.shape)}, expected {groups}")
    if x.stride(-1) != 1 or qweight.stride(-1) != 1 or scales.stride() != zeros.stride():
        raise ValueError("woq GEMM: x and the weight need contiguous rows, scales and zeros "
                         "the same strides")
