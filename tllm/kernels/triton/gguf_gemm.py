"""GGUF block formats multiplied as they are kept (the planes of tllm.kernels.gguf): out [M, N]
= x [M, K] times the weight [N, K]^T, the weight decoded in registers, never written out.

One decoder serves every type (`_dequant_halves`, QTYPE a constexpr): a tile is rows x groups
of 32 values, read as its two halves (the low nibbles: values 0-15 of each group, the high:
16-31), each [BLOCK_N, BLOCK_G, 16], with the 5th / 6th bits OR-ed in from their plane and the
scales loaded once per group ([BLOCK_N, BLOCK_G, 1], broadcast). The activations are loaded at
the positions of each half, so no interleave is needed. Integer values become float32 through
the mantissa of 2^23 (an OR and a subtraction) rather than an int-to-float conversion, which
runs at a quarter of the rate on Hopper; the arithmetic then follows gguf's dequantize.

- `gguf_gemv` (M = 1, batch-1 decode): products accumulate elementwise in a float32
  [BLOCK_N, BLOCK_G, 16] tile, summed once at the end; CUDA cores, no tensor-core padding.
- `gguf_fused_mm` (small M): the decoded halves, cast to x's dtype (what the dense bf16 model
  would hold), go through tl.dot against [BLOCK_M, 16 * BLOCK_G] activation tiles.
- both split K when the N tiles cannot fill the SMs; a second kernel sums the partial tiles in
  a fixed order (deterministic, no atomics).
- `gguf_dequantize`: decoded rows (all, or those `rows` names: the embedding's lookups) in a
  float dtype. `gguf_mm` above the fused kernel's rows decodes the weight and calls cuBLAS: a
  prefill is bound by its FLOPs, and the one-off decode costs a few percent of them.

Reference: tllm.kernels.gguf.dequantize_planes / gguf_mm_ref (gguf's own dequantize for the
values)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tllm.kernels.gguf import GROUP, KERNEL_TYPES, GgufPlanes
from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot, next_pow2, num_sms

QTYPE_CODES = {name: i for i, name in enumerate(KERNEL_TYPES)}
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = range(8)
MAX_FUSED_M = 128   # rows above which gguf_mm decodes the weight once and uses torch.matmul
_MAGIC = tl.constexpr(0x4B000000)  # the bits of 2^23 as float32


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_g: int        # groups of 32 values a K step
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class FusedMmConfig:
    block_m: int
    block_n: int
    block_g: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _as_float(q, offset: tl.constexpr):
    """float32(q - offset) for 0 <= q < 2^22 (int32): q is placed in the mantissa of 2^23."""
    return (q | _MAGIC).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _dequant_halves(qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, j, mask,
                    s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE: tl.constexpr):
    """float32 weights of rows r [BN, 1, 1] (int64), groups g [1, BG, 1] (mask: the groups
    that exist), positions j [1, 1, 16]: (values 32g + j, values 32g + 16 + j)."""
    if QTYPE == 4:  # Q8_0: int8 values, shifted to 0..255 for _as_float
        base = qs_ptr + r * s_qs + g * 32 + j
        lo = tl.load(base, mask=mask, other=0).to(tl.int32) + 128
        hi = tl.load(base + 16, mask=mask, other=0).to(tl.int32) + 128
    else:
        byte = tl.load(qs_ptr + r * s_qs + g * 16 + j, mask=mask, other=0).to(tl.int32)
        lo = byte & 15
        hi = byte >> 4
        if QTYPE == 2 or QTYPE == 3 or QTYPE == 6:  # Q5_0, Q5_1, Q5_K: bit j of the word
            h = tl.load(qh_ptr + r * s_qh + g, mask=mask, other=0)
            lo = lo | (((h >> j) & 1) << 4)
            hi = hi | (((h >> (j + 16)) & 1) << 4)
        if QTYPE == 7:  # Q6_K: 2 bits each, values 0-15 in one word, 16-31 in the next
            h_lo = tl.load(qh_ptr + r * s_qh + 2 * g, mask=mask, other=0)
            h_hi = tl.load(qh_ptr + r * s_qh + 2 * g + 1, mask=mask, other=0)
            lo = lo | (((h_lo >> (2 * j)) & 3) << 4)
            hi = hi | (((h_hi >> (2 * j)) & 3) << 4)
    if QTYPE == 5 or QTYPE == 6:  # Q4_K, Q5_K: (d * sc) * q - dmin * m per 32
        d = tl.load(d_ptr + r * s_d + g // 8, mask=mask, other=0).to(tl.float32)
        dmin = tl.load(dmin_ptr + r * s_dmin + g // 8, mask=mask, other=0).to(tl.float32)
        scale = d * tl.load(sc_ptr + r * s_sc + g, mask=mask, other=0).to(tl.float32)
        low = dmin * tl.load(m_ptr + r * s_m + g, mask=mask, other=0).to(tl.float32)
        w_lo = scale * _as_float(lo, 0) - low
        w_hi = scale * _as_float(hi, 0) - low
    elif QTYPE == 7:  # Q6_K: (d * sc) * (q - 32) per 16
        d = tl.load(d_ptr + r * s_d + g // 8, mask=mask, other=0).to(tl.float32)
        sc_lo = tl.load(sc_ptr + r * s_sc + 2 * g, mask=mask, other=0).to(tl.float32)
        sc_hi = tl.load(sc_ptr + r * s_sc + 2 * g + 1, mask=mask, other=0).to(tl.float32)
        w_lo = (d * sc_lo) * _as_float(lo, 32)
        w_hi = (d * sc_hi) * _as_float(hi, 32)
    else:
        d = tl.load(d_ptr + r * s_d + g, mask=mask, other=0).to(tl.float32)
        if QTYPE == 1 or QTYPE == 3:  # Q4_1, Q5_1: d * q + m
            m = tl.load(m_ptr + r * s_m + g, mask=mask, other=0).to(tl.float32)
            w_lo = d * _as_float(lo, 0) + m
            w_hi = d * _as_float(hi, 0) + m
        elif QTYPE == 0:  # Q4_0: d * (q - 8)
            w_lo = d * _as_float(lo, 8)
            w_hi = d * _as_float(hi, 8)
        elif QTYPE == 2:  # Q5_0: d * (q - 16)
            w_lo = d * _as_float(lo, 16)
            w_hi = d * _as_float(hi, 16)
        else:  # Q8_0: q * d (q shifted by 128 above)
            w_lo = d * _as_float(lo, 128)
            w_hi = d * _as_float(hi, 128)
    return w_lo, w_hi


@triton.jit
def _gguf_gemv_kernel(out_ptr, part_ptr, x_ptr, qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                      N, G, groups_per_split, stride_ps,
                      s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, IS_SPLIT: tl.constexpr):
    """Program (n tile, k split): one activation row against BLOCK_N weight rows over its
    share of the K groups."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = (offs_n % N).to(tl.int64)[:, None, None]   # rows past N are computed, not stored
    j = tl.arange(0, 16)[None, None, :]
    offs_g = tl.arange(0, BLOCK_G)[None, :, None]
    g_lo = pid_k * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, G)
    acc = tl.zeros([BLOCK_N, BLOCK_G, 16], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        g = g0 + offs_g
        mask = g < g_hi
        w_lo, w_hi = _dequant_halves(qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, j,
                                     mask, s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE)
        x_lo = tl.load(x_ptr + g * 32 + j, mask=mask, other=0.0).to(tl.float32)
        x_hi = tl.load(x_ptr + g * 32 + 16 + j, mask=mask, other=0.0).to(tl.float32)
        acc += w_lo * x_lo + w_hi * x_hi
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_n, out, mask=offs_n < N)
    else:
        tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _gguf_mm_kernel(out_ptr, part_ptr, x_ptr, qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                    M, N, G, groups_per_split, stride_xm, stride_om, stride_ps, stride_pm,
                    s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                    IS_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Program (n tile, k split, m tile): BLOCK_M activation rows against BLOCK_N weight rows,
    each half of the decoded tile one tl.dot."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_m = (offs_m % M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = (offs_n % N).to(tl.int64)[:, None, None]
    j = tl.arange(0, 16)[None, None, :]
    offs_g = tl.arange(0, BLOCK_G)[None, :, None]
    c = tl.arange(0, BLOCK_G * 16)           # a half's column: group c // 16, position c % 16
    x_base = x_ptr + rows_m[:, None] * stride_xm
    g_lo = pid_k * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, G)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        g = g0 + offs_g
        w_lo, w_hi = _dequant_halves(qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, j,
                                     g < g_hi, s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE)
        gc = g0 + c // 16
        k_lo = (gc * 32 + c % 16)[None, :]
        x_mask = (gc < g_hi)[None, :]
        x_lo = tl.load(x_base + k_lo, mask=x_mask, other=0.0)
        x_hi = tl.load(x_base + k_lo + 16, mask=x_mask, other=0.0)
        if DOT_FP32:
            x_lo = x_lo.to(tl.float32)
            x_hi = x_hi.to(tl.float32)
        w_lo = tl.trans(tl.reshape(w_lo, (BLOCK_N, BLOCK_G * 16)).to(x_lo.dtype))
        w_hi = tl.trans(tl.reshape(w_hi, (BLOCK_N, BLOCK_G * 16)).to(x_lo.dtype))
        acc = tl.dot(x_lo, w_lo, acc, input_precision=PRECISION)
        acc = tl.dot(x_hi, w_hi, acc, input_precision=PRECISION)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :],
                 acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gguf_dequant_kernel(out_ptr, ids_ptr, qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr,
                         num_rows, N, G, stride_om, s_qs, s_qh, s_d, s_dmin, s_sc, s_m,
                         QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                         HAS_IDS: tl.constexpr):
    """Output row i: weight row ids[i] (or i), decoded; program (row tile, group tile)."""
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = offs < num_rows
    if HAS_IDS:
        rows = tl.load(ids_ptr + offs, mask=valid, other=0)
    else:
        rows = offs % N
    r = rows.to(tl.int64)[:, None, None]
    j = tl.arange(0, 16)[None, None, :]
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)[None, :, None]
    mask = g < G
    w_lo, w_hi = _dequant_halves(qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, j, mask,
                                 s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE)
    dst = out_ptr + offs.to(tl.int64)[:, None, None] * stride_om + g * 32 + j
    store_mask = valid[:, None, None] & mask
    tl.store(dst, w_lo.to(out_ptr.dtype.element_ty), mask=store_mask)
    tl.store(dst + 16, w_hi.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _sum_splits_kernel(out_ptr, part_ptr, N, num_splits, stride_om, stride_ps, stride_pm,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, num_splits):
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- configurations ----

def gemv_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """16 weight rows a program and up to 512 values a K step (a 4096-value float32 tile);
    K is split until about four programs run per SM (a 4096 x 4096 layer makes 256 N tiles
    for the H200's 132 SMs), keeping at least two K steps a split."""
    groups = k // GROUP
    block_n, block_g = 16, min(16, next_pow2(groups))
    tiles, steps = cdiv(n, block_n), cdiv(groups, block_g)
    split = 1
    if tiles < 4 * num_sms(device):
        split = max(1, min(cdiv(4 * num_sms(device), tiles), steps // 2))
    return GemvConfig(block_n, block_g, split)


def fused_mm_config(m: int, n: int, k: int, device: torch.device) -> FusedMmConfig:
    """64 weight rows a program, 128 values (two dots of 64) a K step; K split to fill the SMs
    twice over."""
    groups = k // GROUP
    block_m = min(64, max(16, next_pow2(m)))
    block_n, block_g = 64, min(4, next_pow2(groups))
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    steps = cdiv(groups, block_g)
    split = 1
    if tiles < 2 * num_sms(device):
        split = max(1, min(cdiv(2 * num_sms(device), tiles), steps // 4))
    return FusedMmConfig(block_m, block_n, block_g, split)


# ---- wrappers ----

def _plane_args(planes: GgufPlanes) -> list:
    """(pointers of qs, qh, d, dmin, sc, m; their row strides): absent planes point at qs."""
    tensors = [planes.qs, planes.qh, planes.d, planes.dmin, planes.sc, planes.m]
    pointers = [t if t is not None else planes.qs for t in tensors]
    strides = [t.stride(0) if t is not None else 0 for t in tensors]
    return pointers, strides


def _check(x: torch.Tensor, planes: GgufPlanes) -> None:
    if planes.qtype not in QTYPE_CODES:
        raise ValueError(f"GGUF {planes.qtype} has no GPU kernel")
    if x.dim() != 2 or x.shape[1] != planes.k:
        raise ValueError(f"GGUF GEMM: x {tuple(x.shape)} does not multiply a [{planes.n}, "
                         f"{planes.k}] weight")
    if x.stride(-1) != 1:
        raise ValueError("GGUF GEMM: x needs contiguous rows")
    if not x.is_floating_point():
        raise ValueError(f"GGUF GEMM: x is {x.dtype}, not a float dtype")


def _split(groups: int, block_g: int, split_k: int) -> tuple[int, int]:
    """(groups per split, a multiple of block_g; number of splits)."""
    per_split = cdiv(cdiv(groups, block_g), split_k) * block_g
    return per_split, cdiv(groups, per_split)


def _sum_splits(out: torch.Tensor, part: torch.Tensor) -> None:
    m, n = out.shape
    block = min(1024, next_pow2(n))
    _sum_splits_kernel[(m, cdiv(n, block))](out, part, n, part.shape[0], out.stride(0),
                                            part.stride(0), part.stride(1), BLOCK=block,
                                            num_warps=4)


def gguf_gemv(x: torch.Tensor, planes: GgufPlanes,
              config: GemvConfig | None = None) -> torch.Tensor:
    """x [1, K] times the GGUF weight [N, K]^T -> [1, N] in x's dtype."""
    _check(x, planes)
    if x.shape[0] != 1:
        raise ValueError(f"gguf_gemv takes one row, got {x.shape[0]}")
    n, groups = planes.n, planes.k // GROUP
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    cfg = config or gemv_config(n, planes.k, x.device)
    per_split, num_splits = _split(groups, cfg.block_g, cfg.split_k)
    part = (torch.empty(num_splits, 1, n, dtype=torch.float32, device=x.device)
            if num_splits > 1 else out)
    pointers, strides = _plane_args(planes)
    _gguf_gemv_kernel[(cdiv(n, cfg.block_n), num_splits)](
        out, part, x, *pointers, n, groups, per_split, part.stride(0), *strides,
        QTYPE=QTYPE_CODES[planes.qtype], BLOCK_N=cfg.block_n, BLOCK_G=cfg.block_g,
        IS_SPLIT=num_splits > 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        _sum_splits(out, part)
    return out


def gguf_fused_mm(x: torch.Tensor, planes: GgufPlanes,
                  config: FusedMmConfig | None = None) -> torch.Tensor:
    """x [M, K] times the GGUF weight [N, K]^T -> [M, N] in x's dtype, decoded tiles on the
    tensor cores."""
    _check(x, planes)
    m, n, groups = x.shape[0], planes.n, planes.k // GROUP
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or fused_mm_config(m, n, planes.k, x.device)
    per_split, num_splits = _split(groups, cfg.block_g, cfg.split_k)
    part = (torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
            if num_splits > 1 else out)
    pointers, strides = _plane_args(planes)
    grid = (cdiv(n, cfg.block_n), num_splits, cdiv(m, cfg.block_m))
    _gguf_mm_kernel[grid](
        out, part, x, *pointers, m, n, groups, per_split, x.stride(0), out.stride(0),
        part.stride(0) if num_splits > 1 else 0, part.stride(1) if num_splits > 1 else 0,
        *strides, QTYPE=QTYPE_CODES[planes.qtype], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_G=cfg.block_g, IS_SPLIT=num_splits > 1,
        DOT_FP32=needs_fp32_dot(_gguf_mm_kernel, x.dtype), PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        _sum_splits(out, part)
    return out


def gguf_dequantize(planes: GgufPlanes, rows: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight's rows `rows` (int ids [T]; None: all N) decoded -> [T, K] in `dtype`."""
    if planes.qtype not in QTYPE_CODES:
        raise ValueError(f"GGUF {planes.qtype} has no GPU kernel")
    num_rows = planes.n if rows is None else rows.numel()
    out = torch.empty(num_rows, planes.k, dtype=dtype, device=planes.device)
    if num_rows == 0:
        return out
    groups = planes.k // GROUP
    block_n, block_g = 16, min(16, next_pow2(groups))
    ids = rows.reshape(-1).contiguous() if rows is not None else planes.qs
    pointers, strides = _plane_args(planes)
    _gguf_dequant_kernel[(cdiv(num_rows, block_n), cdiv(groups, block_g))](
        out, ids, *pointers, num_rows, planes.n, groups, out.stride(0), *strides,
        QTYPE=QTYPE_CODES[planes.qtype], BLOCK_N=block_n, BLOCK_G=block_g,
        HAS_IDS=rows is not None, num_warps=4)
    return out


def gguf_mm(x: torch.Tensor, planes: GgufPlanes) -> torch.Tensor:
    """x [M, K] times the GGUF weight [N, K]^T -> [M, N] in x's dtype: the GEMV at one row,
    the fused kernel up to MAX_FUSED_M rows, the decoded weight through torch.matmul above."""
    m = x.shape[0]
    if m == 1:
        return gguf_gemv(x, planes)
    if m <= MAX_FUSED_M:
        return gguf_fused_mm(x, planes)
    _check(x, planes)
    return F.linear(x, gguf_dequantize(planes, dtype=x.dtype))
