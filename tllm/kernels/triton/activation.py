"""SiLU-and-mul for a merged [gate | up] projection: out = silu(gate) * up, in float32 and
rounded once. The reference is `silu_and_mul_ref` below.

`silu_and_mul_quant` ends in FP8 instead: one program per row finds the row's amax, then
quantizes (the second read of gate and up comes from L2), so the down projection reads
1-byte activations and no [tokens, intermediate] bf16 tensor is written or re-read. Its
reference is `silu_and_mul_quant_ref`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels import fp8
from tllm.kernels.triton.fp8_quant import (amax_to_scale, emulates_fp8_cast,
                                           quantize_row_chunk, row_block)
from tllm.kernels.triton.launch import row_num_warps

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_chunk(x_row, start, cols, n_cols):
    """silu(gate) * up of one chunk, rounded to the activation dtype as the unfused output."""
    mask = start + cols < n_cols
    gate = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    return out.to(x_row.dtype.element_ty).to(tl.float32), mask


@triton.jit
def _silu_and_mul_quant_kernel(q_ptr, scale_ptr, x_ptr, n_cols, stride_x, stride_q,
                               BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                               EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if NUM_CHUNKS == 1:  # the row stays in registers
        y, mask = _silu_mul_chunk(x_row, 0, cols, n_cols)
        scale = amax_to_scale(tl.max(tl.abs(y), 0))
        tl.store(q_row + cols, quantize_row_chunk(y, scale, EMULATE).to(q_ptr.dtype.element_ty),
                 mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            y, mask = _silu_mul_chunk(x_row, start, cols, n_cols)
            amax = tl.maximum(amax, tl.abs(y))
        scale = amax_to_scale(tl.max(amax, 0))
        for start in range(0, n_cols, BLOCK):
            y, mask = _silu_mul_chunk(x_row, start, cols, n_cols)
            tl.store(q_row + start + cols,
                     quantize_row_chunk(y, scale, EMULATE).to(q_ptr.dtype.element_ty),
                     mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> [..., I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dimension {x.shape[-1]} is odd")
    n_cols = x.shape[-1] // 2
    x2 = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, x.shape[-1])
    out = torch.empty(*x.shape[:-1], n_cols, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    if x2.shape[0] and n_cols:
        grid = (x2.shape[0], triton.cdiv(n_cols, _BLOCK))
        _silu_and_mul_kernel[grid](out2, x2, n_cols, x2.stride(0), out2.stride(0),
                                   BLOCK=_BLOCK, num_warps=4)
    return out


def silu_and_mul_quant(x: torch.Tensor) -> fp8.QuantizedActivation:
    """x [..., 2 * I] -> silu(gate) * up quantized per token: q fp8 [..., I], scale
    [..., 1] (a fp8.QuantizedActivation of x's dtype)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dimension {x.shape[-1]} is odd")
    n_cols = x.shape[-1] // 2
    x2 = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, x.shape[-1])
    q = torch.empty(*x.shape[:-1], n_cols, dtype=fp8.FP8_DTYPE, device=x.device)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    if x2.shape[0] and n_cols:
        block, chunks = row_block(n_cols)
        _silu_and_mul_quant_kernel[(x2.shape[0],)](
            q, scale, x2, n_cols, x2.stride(0), n_cols, BLOCK=block, NUM_CHUNKS=chunks,
            EMULATE=emulates_fp8_cast(_silu_and_mul_quant_kernel),
            num_warps=row_num_warps(block))
    return fp8.QuantizedActivation(q, scale, x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul_quant_ref(x: torch.Tensor) -> fp8.QuantizedActivation:
    """float32 reference of silu_and_mul_quant."""
    return fp8.quantize_activation(silu_and_mul_ref(x))
