import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a merged [gate | up] projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tllm.kernels.triton.activation import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
