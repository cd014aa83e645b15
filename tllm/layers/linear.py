"""Linear layers, replicated or split across the tensor-parallel ranks.

Parameters are created empty, already the size of this rank's shard: a loader hands each
layer the checkpoint's full tensor and the layer keeps its slice (`load_weight`,
`load_shard`), so no rank ever holds the whole model. Column-parallel layers split their
outputs, row-parallel layers their inputs and sum the partial products (Megatron-LM's
scheme, as TensorRT-LLM and vLLM use it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tllm.distributed import comm


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the "
                         f"model expects {tuple(param.shape)}")
    param.data.copy_(tensor)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"tensor_parallel_size ({parts}) must divide the model's {what} "
                         f"({total})")
    return total // parts


class Linear(nn.Module):
    """The same weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        _copy_checked(getattr(self, param_name), tensor, param_name)


class ColumnParallelLinear(Linear):
    """Output features split across the tp ranks; each rank's output is its slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = comm.tp_rank_and_size()
        super().__init__(in_features, divide(out_features, self.tp_size, "output features"),
                         bias)

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        rows = getattr(self, param_name).shape[0]
        _copy_checked(getattr(self, param_name),
                      tensor.narrow(0, self.tp_rank * rows, rows), param_name)


class RowParallelLinear(Linear):
    """Input features split across the tp ranks; partial products are summed (all-reduce)
    and the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_rank, self.tp_size = comm.tp_rank_and_size()
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features,
                         bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = comm.tp_all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        if param_name == "bias":
            return super().load_weight(param_name, tensor)
        cols = self.weight.shape[1]
        _copy_checked(self.weight, tensor.narrow(1, self.tp_rank * cols, cols), param_name)


class MergedLinear(Linear):
    """Several column-parallel projections of the same input in one matmul (q/k/v,
    gate/up). The checkpoint stores them apart, unsplit; `load_shard` takes this rank's
    rows of one of them."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.tp_rank, self.tp_size = comm.tp_rank_and_size()
        local = [divide(size, self.tp_size, "projection size") for size in output_sizes]
        self._init_local(in_features, local, bias)

    def _init_local(self, in_features: int, local_sizes: list[int], bias: bool) -> None:
        Linear.__init__(self, in_features, sum(local_sizes), bias)
        self.output_sizes = list(local_sizes)  # this rank's sizes

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first row, number of rows) of this rank's slice of checkpoint shard `shard`."""
        rows = self.output_sizes[shard]
        return self.tp_rank * rows, rows

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        first, rows = self.shard_rows(shard)
        if tensor.shape[0] < first + rows or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"shard {shard} of {param_name} has shape {tuple(tensor.shape)}, "
                             f"expected ({rows * self.tp_size}, *{tuple(param.shape[1:])})")
        start = sum(self.output_sizes[:shard])
        param.data[start:start + rows].copy_(tensor.narrow(0, first, rows))

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """Fused q/k/v projection split by heads. When there are fewer kv heads than tp ranks,
    each kv head is replicated on the tp_size // num_kv_heads ranks whose query heads use it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.tp_rank, self.tp_size = comm.tp_rank_and_size()
        self.num_heads = divide(num_heads, self.tp_size, "attention heads")
        if num_kv_heads >= self.tp_size:
            self.num_kv_heads = divide(num_kv_heads, self.tp_size, "kv heads")
            self.kv_head_start = self.tp_rank * self.num_kv_heads
        else:
            if self.tp_size % num_kv_heads:
                raise ValueError(f"the model's {num_kv_heads} kv heads must divide "
                                 f"tensor_parallel_size ({self.tp_size}) to be replicated")
            self.num_kv_heads = 1
            self.kv_head_start = self.tp_rank * num_kv_heads // self.tp_size
        self.head_dim = head_dim
        self._init_local(hidden_size, [self.num_heads * head_dim,
                                       self.num_kv_heads * head_dim,
                                       self.num_kv_heads * head_dim], bias)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        if shard == 0:
            return super().shard_rows(shard)
        return self.kv_head_start * self.head_dim, self.output_sizes[shard]
