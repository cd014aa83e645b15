"""The FP8 GEMMs a linear layer calls, by device: on CUDA cuBLASLt (`torch._scaled_mm`) and
the Triton kernels; elsewhere the exact torch emulation of tllm.kernels.fp8 (CI runs it)."""
from __future__ import annotations

import torch

from tllm.kernels import fp8 as ref


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (model dtype) times an fp8 weight [N, K] with per-channel scales [N, 1];
    activations quantized per token, or with the static per-tensor `input_scale`."""
    if input_scale is None:
        xq, x_scale = ref.quantize_per_token(x)
    else:
        xq, x_scale = ref.quantize_static(x, input_scale), input_scale.float().reshape(1, 1)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        x_scale = x_scale.expand(xq.shape[0], 1).contiguous()
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale,
                                scale_b=weight_scale.float().reshape(1, -1),
                                out_dtype=x.dtype)
    return ref.scaled_mm_ref(xq, x_scale, weight, weight_scale, x.dtype)


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] times an fp8 weight [N, K] with block scales [ceil(N/bn), ceil(K/bk)];
    activations quantized per token and group of bk columns."""
    xq, x_scale = ref.quantize_per_token_group(x, block[1])
    return ref.block_scaled_mm_ref(xq, x_scale, weight, weight_scale, block, x.dtype)
