"""A batch-invariant GEMM for deterministic mode on CUDA: x [M, K] times a row-major weight
W [N, K], fp32 accumulation. cuBLAS picks its kernel (tile shape, split-K) by M, so a row's
product changes with the batch; here every launch has the same tiles (BLOCK_M x BLOCK_N,
K walked in BLOCK_K steps, in order, no split-K, no atomics), so each output element is the
same sum in the same order whatever M is and wherever its row falls in a tile. Slower than
cuBLAS (one fixed configuration). `invariant_matmul_ref` is the reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import dot_precision, needs_fp32_dot

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64   # fixed: the invariance rests on it


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong (tllm.kernels.triton.launch)
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T in x's dtype, the same bits for a row at any M."""
    x = x.contiguous()
    weight = weight.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                         DOT_FP32=needs_fp32_dot(_matmul_kernel, x.dtype),
                         PRECISION=dot_precision(x.dtype))
    return out


def invariant_matmul_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).to(x.dtype)
