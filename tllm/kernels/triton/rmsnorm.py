"""RMSNorm with an optional fused residual add, one row per program. Numerics follow
tllm/layers/norm.py (and HF): the sum x + residual is rounded to the input dtype, the norm is
computed in float32, rounded to the input dtype, then multiplied by the weight. The reference
is `rms_norm_ref` below.

`rms_norm_quant` is the same kernel ending in FP8: the normalized row (rounded to the input
dtype, as the unfused output would be) is quantized per token in registers, so an FP8 linear
layer after it reads 1-byte activations and no quantization pass runs between them. Its
reference is `rms_norm_quant_ref`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels import fp8
from tllm.kernels.triton.fp8_quant import amax_to_scale, emulates_fp8_cast, quantize_row_chunk
from tllm.kernels.triton.launch import next_pow2, row_num_warps


@triton.jit
def _rms_norm_kernel(out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, scale_ptr,
                     eps, n_cols, stride_x, stride_r, stride_o, stride_ro,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                     EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANT:  # fp8 per token: out_ptr is e4m3, scale_ptr one float32 per row
        y = (w * normed).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = amax_to_scale(tl.max(tl.abs(y), 0))
        tl.store(out_ptr + row * stride_o + cols,
                 quantize_row_chunk(y, scale, EMULATE).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty),
                 mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """Returns weight * norm(x), or with `residual` (out, x + residual) like RMSNorm.forward."""
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    res_out = _launch(out, None, x, weight, eps, residual)
    return out if residual is None else (out, res_out)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """rms_norm with an fp8 output quantized per token: a fp8.QuantizedActivation (q [..., H],
    scale [..., 1], dtype x's), or with `residual` (that, x + residual)."""
    q = torch.empty(x.shape, dtype=fp8.FP8_DTYPE, device=x.device)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    res_out = _launch(q, scale, x, weight, eps, residual)
    out = fp8.QuantizedActivation(q, scale, x.dtype)
    return out if residual is None else (out, res_out)


def _launch(out, scale, x, weight, eps, residual):
    hidden = x.shape[-1]
    x2 = _rows(x)
    out2 = out.view(-1, hidden)
    r2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x) if residual is not None else None
    ro2 = res_out.view(-1, hidden) if res_out is not None else out2
    block = next_pow2(hidden)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            out2, ro2, x2, r2, weight, scale if scale is not None else weight, eps, hidden,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0), BLOCK=block,
            HAS_RESIDUAL=residual is not None, QUANT=scale is not None,
            EMULATE=emulates_fp8_cast(_rms_norm_kernel), num_warps=row_num_warps(block))
    return res_out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows, hidden] view with a contiguous last dimension (copying only if needed)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """float32 reference (the rounding of the sum to x's dtype kept, as the module does)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    out = weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
    return out if residual is None else (out, residual)


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    """float32 reference of rms_norm_quant: the float32 norm, quantized per token."""
    out = rms_norm_ref(x, weight, eps, residual)
    if residual is None:
        return fp8.quantize_activation(out)
    return fp8.quantize_activation(out[0]), out[1]
