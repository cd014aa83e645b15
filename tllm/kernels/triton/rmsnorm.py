"""RMSNorm with an optional fused residual add, one row per program. Numerics follow
tllm/layers/norm.py (and HF): the sum x + residual is rounded to the input dtype, the norm is
computed in float32, rounded to the input dtype, then multiplied by the weight. The reference
is `rms_norm_ref` below."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import next_pow2, row_num_warps


@triton.jit
def _rms_norm_kernel(out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps, n_cols,
                     stride_x, stride_r, stride_o, stride_ro,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
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
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """Returns weight * norm(x), or with `residual` (out, x + residual) like RMSNorm.forward."""
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    out2 = out.view(-1, hidden)
    r2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x) if residual is not None else None
    ro2 = res_out.view(-1, hidden) if res_out is not None else out2
    block = next_pow2(hidden)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            out2, ro2, x2, r2, weight, eps, hidden, x2.stride(0), r2.stride(0), out2.stride(0),
            ro2.stride(0), BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=row_num_warps(block))
    return out if residual is None else (out, res_out)


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
