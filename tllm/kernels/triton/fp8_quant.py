"""Activation quantization to FP8 e4m3 in one Triton pass: per token (dynamic), with a
given per-tensor scale (static), and per token and group of columns (the input of the
block-scaled GEMM); plus the cast helper the fused kernels (RMSNorm, SiLU-and-mul, the KV
cache write) share. Scales follow tllm.kernels.fp8: real = fp8 * scale, dynamic scales are
amax / 448; those references (quantize_per_token, quantize_static, quantize_per_token_group)
are what the kernels must match, byte for byte."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels import fp8 as ref
from tllm.kernels.triton.launch import cdiv, next_pow2, row_num_warps

FP8_MAX = tl.constexpr(ref.FP8_MAX)       # 448
MIN_SCALE = tl.constexpr(ref.MIN_SCALE)   # an all-zero row keeps a finite scale
_MAX_ROW_BLOCK = 4096   # columns a per-token program holds at once; longer rows loop twice
_STATIC_BLOCK = 1024


def emulates_fp8_cast(kernel) -> bool:
    """The Triton interpreter (3.9) rounds fp32 -> e4m3 wrongly (ties away from zero, and a
    mantissa carry drops the exponent: -31.9 became -16). Kernels run interpreted round in
    fp32 first (fp8_saturate with EMULATE), so the cast they end with is exact; compiled
    kernels use the hardware's correct round-to-nearest-even conversion."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(kernel, InterpretedFunction)


@triton.jit
def fp8_saturate(y, EMULATE: tl.constexpr):
    """y (float32) clamped to e4m3's range; with EMULATE also rounded to the nearest e4m3
    value (ties to even) in fp32 arithmetic, so that the cast to fp8 that follows is exact."""
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if EMULATE:
        exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
        # e4m3 keeps 3 mantissa bits; below 2^-6 it is subnormal with a fixed step of 2^-9
        step = ((tl.maximum(exponent, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
        v = y / step                                   # exact: a power of two
        v = (v + 12582912.0) - 12582912.0              # 1.5 * 2^23: rint, ties to even
        y = tl.where(v == 0.0, y * 0.0, v * step)      # keeps the sign of zero
    return y


@triton.jit
def quantize_row_chunk(x, scale, EMULATE: tl.constexpr):
    """float32 values divided by their scale (IEEE division, as torch does), ready to store."""
    return fp8_saturate(tl.math.div_rn(x, scale), EMULATE)


@triton.jit
def amax_to_scale(amax):
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def _per_token_kernel(q_ptr, scale_ptr, x_ptr, n_cols, stride_x, stride_q,
                      BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    if NUM_CHUNKS == 1:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        scale = amax_to_scale(tl.max(tl.abs(x), 0))
        tl.store(q_ptr + row * stride_q + cols,
                 quantize_row_chunk(x, scale, EMULATE).to(q_ptr.dtype.element_ty), mask=mask)
    else:  # amax first, then quantize: the second read comes from L2
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = amax_to_scale(tl.max(amax, 0))
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_q + start + cols,
                     quantize_row_chunk(x, scale, EMULATE).to(q_ptr.dtype.element_ty),
                     mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _static_kernel(q_ptr, x_ptr, scale_ptr, n_cols, stride_x, stride_q, BLOCK: tl.constexpr,
                   EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    scale = tl.load(scale_ptr)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * stride_q + cols,
             quantize_row_chunk(x, scale, EMULATE).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _group_kernel(q_ptr, scale_ptr, x_ptr, n_cols, n_groups, stride_x, stride_q, stride_s,
                  GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
                  EMULATE: tl.constexpr):
    """One program: GROUPS_PER_PROGRAM consecutive groups of one row, a [groups, GROUP] tile."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = amax_to_scale(tl.max(tl.abs(x), 1))
    tl.store(q_ptr + row * stride_q + cols,
             quantize_row_chunk(x, scale[:, None], EMULATE).to(q_ptr.dtype.element_ty),
             mask=mask)
    tl.store(scale_ptr + row * stride_s + groups, scale, mask=groups < n_groups)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def row_block(n_cols: int) -> tuple[int, int]:
    """(columns per chunk, chunks) of a per-token program over a row of n_cols."""
    block = min(next_pow2(max(n_cols, 1)), _MAX_ROW_BLOCK)
    return block, cdiv(n_cols, block)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (fp8 [..., K], float32 scale [..., 1]); ref.quantize_per_token."""
    x2 = _rows(x)
    q = torch.empty(x.shape, dtype=ref.FP8_DTYPE, device=x.device)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    if x2.shape[0] and x2.shape[1]:
        block, chunks = row_block(x2.shape[1])
        _per_token_kernel[(x2.shape[0],)](
            q, scale, x2, x2.shape[1], x2.stride(0), x2.shape[1], BLOCK=block,
            NUM_CHUNKS=chunks, EMULATE=emulates_fp8_cast(_per_token_kernel),
            num_warps=row_num_warps(block))
    return q, scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] with a per-tensor scale (a one-element float32 tensor) -> fp8 [..., K]."""
    x2 = _rows(x)
    q = torch.empty(x.shape, dtype=ref.FP8_DTYPE, device=x.device)
    if x2.shape[0] and x2.shape[1]:
        block = min(_STATIC_BLOCK, next_pow2(x2.shape[1]))
        _static_kernel[(x2.shape[0], cdiv(x2.shape[1], block))](
            q, x2, scale.float().reshape(1), x2.shape[1], x2.stride(0), x2.shape[1],
            BLOCK=block, EMULATE=emulates_fp8_cast(_static_kernel), num_warps=4)
    return q


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, ceil(K / group)]); `group` a power of two
    (ref.quantize_per_token_group)."""
    if group & (group - 1) or group < 1:
        raise ValueError(f"per-token-group quantization needs a power-of-two group, got {group}")
    x2 = _rows(x)
    m, k = x2.shape
    n_groups = cdiv(k, group)
    q = torch.empty(m, k, dtype=ref.FP8_DTYPE, device=x.device)
    scale = torch.empty(m, n_groups, dtype=torch.float32, device=x.device)
    if m and k:
        per_program = max(1, min(next_pow2(n_groups), 2048 // group))
        _group_kernel[(m, cdiv(n_groups, per_program))](
            q, scale, x2, k, n_groups, x2.stride(0), q.stride(0), scale.stride(0),
            GROUP=group, GROUPS_PER_PROGRAM=per_program,
            EMULATE=emulates_fp8_cast(_group_kernel), num_warps=4)
    return q, scale
