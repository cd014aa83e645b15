import functools

import torch
import torch.nn.functional as F
from torch import nn

from tllm.kernels import fp8
from tllm.layers.invariant_ops import row_tiled


def _check_quantize_to(activation: nn.Module, quantize_to: torch.dtype | None) -> None:
    if quantize_to is not None and quantize_to != fp8.FP8_DTYPE:
        raise ValueError(f"{type(activation).__name__} quantizes to {fp8.FP8_DTYPE} only, "
                         f"not {quantize_to}")


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a merged [gate | up] projection output. With `quantize_to` (fp8
    e4m3, asked for by the FP8 down projection) the output is a fp8.QuantizedActivation,
    quantized per token: in the same kernel on CUDA."""

    is_row_tiled = False  # deterministic mode on the CPU (tllm.layers.batch_invariant)

    def forward(self, x: torch.Tensor, quantize_to: torch.dtype | None = None):
        _check_quantize_to(self, quantize_to)
        if x.is_cuda and quantize_to is None and torch.compiler.is_compiling():
            from tllm.kernels import custom_ops  # the kernel as an op the compiler keeps whole
            return custom_ops.silu_and_mul(x)
        if x.is_cuda:
            from tllm.kernels.triton.activation import silu_and_mul, silu_and_mul_quant
            return (silu_and_mul if quantize_to is None else silu_and_mul_quant)(x)
        gate, up = x.chunk(2, dim=-1)
        out = (row_tiled(F.silu, gate) if self.is_row_tiled else F.silu(gate)) * up
        return out if quantize_to is None else fp8.quantize_activation(out)


class GeluAndMul(nn.Module):
    """gelu(gate) * up for a merged [gate | up] projection output: Gemma's gated MLP
    (`approximate="tanh"`: HF's gelu_pytorch_tanh). `quantize_to` as in SiluAndMul."""

    is_row_tiled = False

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor, quantize_to: torch.dtype | None = None):
        _check_quantize_to(self, quantize_to)
        gate, up = x.chunk(2, dim=-1)
        gelu = functools.partial(F.gelu, approximate=self.approximate)
        out = (row_tiled(gelu, gate) if self.is_row_tiled else gelu(gate)) * up
        return out if quantize_to is None else fp8.quantize_activation(out)
