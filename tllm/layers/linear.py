"""Linear layers. Parameters are created empty: a loader (or the dummy initialiser) fills them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q/k/v, gate/up). The checkpoint
    stores them apart; `load_shard` copies one of them into its rows."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        start = sum(self.output_sizes[:shard])
        param = getattr(self, param_name)
        if tensor.shape[0] != self.output_sizes[shard] or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"shard {shard} of {param_name} has shape {tuple(tensor.shape)}, "
                             f"expected ({self.output_sizes[shard]}, *{tuple(param.shape[1:])})")
        param.data[start:start + tensor.shape[0]].copy_(tensor)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.output_sizes, dim=-1)
