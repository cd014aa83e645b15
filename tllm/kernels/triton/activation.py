"""SiLU-and-mul for a merged [gate | up] projection: out = silu(gate) * up, in float32 and
rounded once. The reference is `silu_and_mul_ref` below."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
