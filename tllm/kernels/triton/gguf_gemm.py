"""GGUF block formats multiplied as they are kept (the planes of tllm.kernels.gguf): out [M, N]
= x [M, K] times the weight [N, K]^T, the weight decoded in registers (gguf_decode), never
written out.

- `gguf_gemv` (M = 1, batch-1 decode), on CUDA cores: a program takes BLOCK_N weight rows
  and BLOCK_G groups of 32 values a K step, as [BLOCK_N, BLOCK_G, 16] tiles of its low and
  high half-groups; it sums q * x over each half-group (the integers less the type's offset,
  in float32: exact), then scales once a half-group and adds low * sum(x) once a group. The
  accumulator is one float32 a (row, group) of the tile: few registers, so many programs fit
  on an SM and keep many loads in flight (a GEMV is bound by the bytes it reads).
- `gguf_fused_mm` (2..MAX_FUSED_M rows): per half-group, the [16, BLOCK_N] weight tile (its
  16 bytes of each row, contiguous) is decoded once and multiplied into all BLOCK_M rows by
  one tl.dot of depth 16, its scales a [1, BLOCK_N] row; BLOCK_G half-group pairs a K step
  (unrolled). FusedMmConfig(tile=True) runs the first kernel instead (a [BLOCK_N, 16 BLOCK_G]
  tile decoded, then transposed for the dot), for the sweep's comparison.
- both split K when the N (x M) tiles cannot fill the SMs. By default the last program to
  finish a tile sums the partials in split order (a counter per tile, reset by that program:
  deterministic, one launch); fold=False sums them in a second kernel.
- `gguf_dequantize`: decoded rows (all, or those `rows` names: the embedding's lookups) in a
  float dtype. `gguf_mm` above the fused kernel's rows decodes the weight and calls cuBLAS: a
  prefill is bound by its FLOPs, and the one-off decode costs a few percent of them.

Reference: tllm.kernels.gguf.dequantize_planes / gguf_mm_ref (gguf's own dequantize for the
values)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tllm.kernels.gguf import GROUP, KERNEL_TYPES, GgufPlanes
from tllm.kernels.triton.gguf_configs import FusedMmConfig, GemvConfig  # noqa: F401
from tllm.kernels.triton.gguf_configs import fused_mm_config, gemv_config
from tllm.kernels.triton.gguf_decode import dequant_halves, scales, values
from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot, next_pow2

QTYPE_CODES = {name: i for i, name in enumerate(KERNEL_TYPES)}
MAX_FUSED_M = 128   # rows above which gguf_mm decodes the weight once and uses torch.matmul
NO_SPLIT, TWO_PASS, FOLD = 0, 1, 2


@triton.jit
def _finish(acc, out_ptrs, part_ptrs, lock_ptr, mask, stride_ps, SPLIT: tl.constexpr):
    """Store a program's result: the output (no split), or its partial; with FOLD the last
    split of the tile to arrive sums every partial in split order into the output."""
    if SPLIT == 0:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptrs + tl.program_id(1) * stride_ps, acc, mask=mask)
        if SPLIT == 2:
            num_splits = tl.num_programs(1)
            tl.debug_barrier()  # every thread's partial is written before the count
            arrived = tl.atomic_add(lock_ptr, 1)  # acq_rel, GPU scope
            if arrived == num_splits - 1:
                total = tl.zeros_like(acc)
                for s in range(0, num_splits):
                    total += tl.load(part_ptrs + s * stride_ps, mask=mask, other=0.0,
                                     cache_modifier=".cg")
                tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr, 0)  # ready for the next call (graph replays too)


@triton.jit
def _gguf_gemv_kernel(out_ptr, part_ptr, lock_ptr, x_ptr, qs_ptr, qh_ptr, d_ptr, dmin_ptr,
                      sc_ptr, m_ptr, N, G, groups_per_split, stride_ps,
                      s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, SPLIT: tl.constexpr,
                      BROADCAST_X: tl.constexpr):
    """Program (n tile, k split): one activation row against BLOCK_N weight rows over its
    share of the K groups."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = (offs_n % N).to(tl.int64)[:, None, None]   # rows past N are computed, not stored
    # a group's 16 bytes as two rows of 8 (c even: bytes 0-7, odd: 8-15): its qs and x loads
    # then share one register layout (8 bytes a thread, 8 bf16 a thread), sums stay in-thread
    c = tl.arange(0, 2 * BLOCK_G)[None, :, None]
    jb = (c % 2) * 8
    jt = tl.arange(0, 8)[None, None, :]
    j = jb + jt
    g_lo = tl.program_id(1) * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, G)
    acc = tl.zeros([BLOCK_N, 2 * BLOCK_G, 1], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        g = g0 + c // 2
        mask = g < g_hi
        q_lo, q_hi = values(qs_ptr, qh_ptr, r, g, jb, jt, mask, s_qs, s_qh, QTYPE)
        # x's [1, 2 BLOCK_G, 8] tile takes the weights' layout (8 a thread, every row of the
        # tile in each thread: x converted once for all of them) when it has 8 values for
        # each thread; a smaller one would spread thinner, and the decoded weights would be
        # converted to its layout (through shared memory) instead: then x is loaded at the
        # tile's full shape, each row's copy from L1.
        x_at = x_ptr + g * 32 + j
        if BROADCAST_X:
            x_at = tl.broadcast_to(x_at, [BLOCK_N, 2 * BLOCK_G, 8])
        x_lo = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        x_hi = tl.load(x_at + 16, mask=mask, other=0.0).to(tl.float32)
        s_lo, s_hi, low = scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, mask, s_d, s_dmin,
                                 s_sc, s_m, QTYPE)
        if QTYPE == 0 or QTYPE == 1 or QTYPE == 5 or QTYPE == 7:  # the halves' own scales
            acc += (s_lo * tl.sum(q_lo * x_lo, axis=2, keep_dims=True)
                    + s_hi * tl.sum(q_hi * x_hi, axis=2, keep_dims=True))
        else:
            acc += s_lo * tl.sum(q_lo * x_lo + q_hi * x_hi, axis=2, keep_dims=True)
        if QTYPE == 1 or QTYPE == 3 or QTYPE == 5 or QTYPE == 6:  # + low * sum(x)
            acc += low * tl.sum(x_lo + x_hi, axis=2, keep_dims=True)
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    _finish(out, out_ptr + offs_n, part_ptr + offs_n, lock_ptr + pid_n, offs_n < N,
            stride_ps, SPLIT)


@triton.jit
def _gguf_mm_kernel(out_ptr, part_ptr, lock_ptr, x_ptr, qs_ptr, qh_ptr, d_ptr, dmin_ptr,
                    sc_ptr, m_ptr, M, N, G, groups_per_split, stride_xm, stride_om, stride_ps,
                    stride_pm, s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Program (n tile, k split, m tile): BLOCK_M activation rows against BLOCK_N weight rows;
    each half-group's decoded [16, BLOCK_N] tile one tl.dot."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = (offs_n % N).to(tl.int64)[None, :]
    j = tl.arange(0, 16)[:, None]
    x_base = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm + tl.arange(0, 16)[None, :]
    zero_n = tl.zeros([1, BLOCK_N], dtype=tl.int32)
    zero_16 = tl.zeros([1, 16], dtype=tl.int32)
    g_lo = tl.program_id(1) * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, G)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        for i in tl.static_range(BLOCK_G):
            g = g0 + i
            # the group's masks as blocks: [1, BLOCK_N] for the weights, [1, 16] for x
            w_mask = (zero_n + g) < g_hi
            x_mask = (zero_16 + g) < g_hi
            w_lo, w_hi = dequant_halves(qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, j,
                                        w_mask, s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE)
            x_lo = tl.load(x_base + g * 32, mask=x_mask, other=0.0)
            x_hi = tl.load(x_base + g * 32 + 16, mask=x_mask, other=0.0)
            if DOT_FP32:
                x_lo = x_lo.to(tl.float32)
                x_hi = x_hi.to(tl.float32)
            acc = tl.dot(x_lo, w_lo.to(x_lo.dtype), acc, input_precision=PRECISION)
            acc = tl.dot(x_hi, w_hi.to(x_hi.dtype), acc, input_precision=PRECISION)
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    part_offs = offs_m[:, None] * stride_pm + offs_n[None, :]
    _finish(acc, out_ptr + out_offs, part_ptr + part_offs,
            lock_ptr + pid_m * tl.num_programs(0) + pid_n,
            (offs_m < M)[:, None] & (offs_n < N)[None, :], stride_ps, SPLIT)


@triton.jit
def _gguf_mm_tile_kernel(out_ptr, part_ptr, lock_ptr, x_ptr, qs_ptr, qh_ptr, d_ptr, dmin_ptr,
                         sc_ptr, m_ptr, M, N, G, groups_per_split, stride_xm, stride_om,
                         stride_ps, stride_pm, s_qs, s_qh, s_d, s_dmin, s_sc, s_m,
                         QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_G: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
                         PRECISION: tl.constexpr):
    """The first fused kernel: a [BLOCK_N, BLOCK_G, 16] tile of each half decoded, reshaped
    and transposed into one tl.dot of depth 16 BLOCK_G."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = (offs_n % N).to(tl.int64)[:, None, None]
    j = tl.arange(0, 16)[None, None, :]
    offs_g = tl.arange(0, BLOCK_G)[None, :, None]
    c = tl.arange(0, BLOCK_G * 16)           # a half's column: group c // 16, position c % 16
    x_base = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm
    g_lo = tl.program_id(1) * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, G)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        g = g0 + offs_g
        w_lo, w_hi = dequant_halves(qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, j,
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
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    part_offs = offs_m[:, None] * stride_pm + offs_n[None, :]
    _finish(acc, out_ptr + out_offs, part_ptr + part_offs,
            lock_ptr + pid_m * tl.num_programs(0) + pid_n,
            (offs_m < M)[:, None] & (offs_n < N)[None, :], stride_ps, SPLIT)


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
    w_lo, w_hi = dequant_halves(qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, j, mask,
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


# ---- wrappers ----

_LOCKS: dict[tuple[str, int, int], torch.Tensor] = {}


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


def _split_mode(planes: GgufPlanes, num_splits: int, fold: bool, tiles: int,
                out: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(SPLIT mode, the tiles' counters): a layer's zeroed counters are made on its first
    split call (outside a CUDA graph capture: during one it sums in a second kernel)."""
    if num_splits == 1:
        return NO_SPLIT, out
    if not fold:
        return TWO_PASS, out
    key = (str(out.device), planes.qs.data_ptr(), tiles)
    locks = _LOCKS.get(key)
    if locks is None:
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            return TWO_PASS, out
        locks = _LOCKS[key] = torch.zeros(tiles, dtype=torch.int32, device=out.device)
    return FOLD, locks


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
    cfg = config or gemv_config(planes.qtype, n, planes.k, x.device)
    per_split, num_splits = _split(groups, cfg.block_g, cfg.split_k)
    tiles = cdiv(n, cfg.block_n)
    mode, locks = _split_mode(planes, num_splits, cfg.fold, tiles, out)
    part = (torch.empty(num_splits, 1, n, dtype=torch.float32, device=x.device)
            if num_splits > 1 else out)
    pointers, strides = _plane_args(planes)
    _gguf_gemv_kernel[(tiles, num_splits)](
        out, part, locks, x, *pointers, n, groups, per_split, part.stride(0), *strides,
        QTYPE=QTYPE_CODES[planes.qtype], BLOCK_N=cfg.block_n, BLOCK_G=cfg.block_g,
        SPLIT=mode, BROADCAST_X=16 * cfg.block_g < 8 * 32 * cfg.num_warps,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if mode == TWO_PASS:
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
    cfg = config or fused_mm_config(planes.qtype, m, n, planes.k, x.device)
    per_split, num_splits = _split(groups, cfg.block_g, cfg.split_k)
    grid = (cdiv(n, cfg.block_n), num_splits, cdiv(m, cfg.block_m))
    mode, locks = _split_mode(planes, num_splits, cfg.fold, grid[0] * grid[2], out)
    part = (torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
            if num_splits > 1 else out)
    pointers, strides = _plane_args(planes)
    kernel = _gguf_mm_tile_kernel if cfg.tile else _gguf_mm_kernel
    kernel[grid](
        out, part, locks, x, *pointers, m, n, groups, per_split, x.stride(0), out.stride(0),
        part.stride(0), part.stride(1) if num_splits > 1 else n, *strides,
        QTYPE=QTYPE_CODES[planes.qtype], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_G=cfg.block_g, SPLIT=mode, DOT_FP32=needs_fp32_dot(kernel, x.dtype),
        PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if mode == TWO_PASS:
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
