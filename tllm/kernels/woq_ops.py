"""The weight-only int4/int8 product a linear layer calls, by device: the Triton kernels of
tllm.kernels.triton.w4a16_gemm on CUDA (bf16/fp16/fp32 activations), elsewhere the torch
reference (dequantize, then matmul in the activations' dtype), which CI runs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tllm.kernels.woq import WoqLayout, dequantize


def woq_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, layout: WoqLayout,
               perm: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times the packed weight [N, K] -> [..., N] in x's dtype; `perm` gathers x's
    features into the weight's stored order first (act-order checkpoints)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if perm is not None:
        x2 = x2.index_select(1, perm)
    if x2.is_cuda:
        from tllm.kernels.triton.w4a16_gemm import woq_mm
        out = woq_mm(x2.contiguous(), qweight, scales, zeros, layout)
    else:
        out = F.linear(x2, dequantize(qweight, scales, zeros, layout).to(x.dtype))
    return out.reshape(*shape[:-1], out.shape[-1])
