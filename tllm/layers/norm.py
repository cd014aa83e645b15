from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tllm.kernels import fp8


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF does; with `residual`, adds it first and returns
    the sum as the new residual (one pass instead of two). With `quantize_to` (fp8 e4m3,
    asked for by an FP8 linear layer after it) the output is a fp8.QuantizedActivation,
    quantized per token: in the same kernel on CUDA."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                quantize_to: torch.dtype | None = None):
        if quantize_to is not None and quantize_to != fp8.FP8_DTYPE:
            raise ValueError(f"RMSNorm quantizes to {fp8.FP8_DTYPE} only, not {quantize_to}")
        if x.is_cuda and quantize_to is None and torch.compiler.is_compiling():
            from tllm.kernels import custom_ops  # the kernel as an op the compiler keeps whole
            if residual is None:
                return custom_ops.rms_norm(x, self.weight, self.eps)
            return custom_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if x.is_cuda:  # one fused Triton kernel instead of ~8 elementwise ones
            from tllm.kernels.triton.rmsnorm import rms_norm, rms_norm_quant
            return (rms_norm if quantize_to is None else rms_norm_quant)(
                x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:  # the same arithmetic as below, in one op's C++
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * h.to(x.dtype)
        if quantize_to is not None:
            out = fp8.quantize_activation(out)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32 and cast
    back at the end (Llama's RMSNorm casts before the weight); the checkpoint stores the
    weight around 0. With `residual`, adds it first and returns the sum as the new residual,
    as RMSNorm does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)
