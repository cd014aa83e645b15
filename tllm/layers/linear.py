"""Linear layers, replicated or split across the tensor-parallel ranks.

Parameters are created empty, already the size of this rank's shard: a loader hands each
layer the checkpoint's full tensor and the layer keeps its slice (`load_weight`,
`load_shard`), so no rank ever holds the whole model. Column-parallel layers split their
outputs, row-parallel layers their inputs and sum the partial products (Megatron-LM's
scheme, as TensorRT-LLM and vLLM use it)."""
from __future__ import annotations

import torch
from torch import nn

from tllm.distributed import comm
from tllm.layers.quant.base import (PER_OUTPUT, UNQUANTIZED, ParamLayout, QuantMethod,
                                    add_param)


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        # a scale stored as [n] where we keep [n, 1] (or a scalar as [1]) is the same data
        if tensor.numel() != param.numel() or tensor.squeeze().shape != param.squeeze().shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(param.shape)}")
        tensor = tensor.reshape(param.shape)
    param.data.copy_(tensor)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"tensor_parallel_size ({parts}) must divide the model's {what} "
                         f"({total})")
    return total // parts


def _narrow(tensor: torch.Tensor, dim: int | None, index: int, size: int) -> torch.Tensor:
    """Shard `index` of `size` elements along `dim` (no-op for dim None)."""
    return tensor if dim is None else tensor.narrow(dim, index * size, size)


class Linear(nn.Module):
    """The same weight on every rank. How the weight is stored and multiplied is the
    layer's quantization method (`quant`); the layer owns its shape and sharding."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant: QuantMethod = UNQUANTIZED, num_shards: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant = quant
        self.param_layouts: dict[str, ParamLayout] = {}
        quant.create_weights(self, in_features, out_features, num_shards)
        if bias:
            add_param(self, "bias", torch.empty(out_features), PER_OUTPUT)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant.apply_with_bias(self, x, self.bias)

    def load_weight(self, param_name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's part of a full (unsplit) checkpoint tensor into a parameter."""
        param, layout = getattr(self, param_name), self.param_layouts[param_name]
        if layout.per_shard:  # one entry of [shards, ...]; split along an input dim if any
            inner = ParamLayout(None, None if layout.input_dim is None else layout.input_dim - 1)
            _copy_checked(param.data[0], self.rank_slice(tensor, param.data[0], inner),
                          param_name)
        else:
            _copy_checked(param, self.rank_slice(tensor, param, layout), param_name)

    def rank_slice(self, tensor: torch.Tensor, param: torch.Tensor,
                   layout: ParamLayout) -> torch.Tensor:
        return tensor


class ColumnParallelLinear(Linear):
    """Output features split across the tp ranks; each rank's output is its slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant: QuantMethod = UNQUANTIZED) -> None:
        self.tp_rank, self.tp_size = comm.tp_rank_and_size()
        super().__init__(in_features, divide(out_features, self.tp_size, "output features"),
                         bias, quant)

    def rank_slice(self, tensor, param, layout):
        dim = layout.output_dim
        return _narrow(tensor, dim, self.tp_rank, param.shape[dim] if dim is not None else 0)


class RowParallelLinear(Linear):
    """Input features split across the tp ranks; partial products are summed (all-reduce)
    and the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant: QuantMethod = UNQUANTIZED) -> None:
        self.tp_rank, self.tp_size = comm.tp_rank_and_size()
        super().__init__(divide(in_features, self.tp_size, "input features"), out_features,
                         bias, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = comm.tp_all_reduce(self.quant.apply(self, x))
        return out if self.bias is None else out + self.bias

    def rank_slice(self, tensor, param, layout):
        dim = layout.input_dim
        return _narrow(tensor, dim, self.tp_rank, param.shape[dim] if dim is not None else 0)


class MergedLinear(Linear):
    """Several column-parallel projections of the same input in one matmul (q/k/v,
    gate/up). The checkpoint stores them apart, unsplit; `load_shard` takes this rank's
    rows of one of them."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 quant: QuantMethod = UNQUANTIZED) -> None:
        self.tp_rank, self.tp_size = comm.tp_rank_and_size()
        local = [divide(size, self.tp_size, "projection size") for size in output_sizes]
        self._init_local(in_features, local, bias, quant)

    def _init_local(self, in_features: int, local_sizes: list[int], bias: bool,
                    quant: QuantMethod) -> None:
        Linear.__init__(self, in_features, sum(local_sizes), bias, quant, len(local_sizes))
        self.output_sizes = list(local_sizes)  # this rank's sizes

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first row, number of rows) of this rank's slice of checkpoint shard `shard`."""
        rows = self.output_sizes[shard]
        return self.tp_rank * rows, rows

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        param, layout = getattr(self, param_name), self.param_layouts[param_name]
        if layout.per_shard:
            _copy_checked(param.data[shard], tensor, f"{param_name} (shard {shard})")
            return
        dim, units = layout.output_dim, layout.output_units
        first, rows = self.shard_rows(shard)
        start = sum(self.output_sizes[:shard])
        if first % units or rows % units or start % units:
            raise ValueError(f"{param_name}: shard {shard} ({rows} rows from {first}) does not "
                             f"fall on whole blocks of {units} rows")
        first, rows, start = first // units, rows // units, start // units
        other = [n for d, n in enumerate(param.shape) if d != dim]
        if (tensor.shape[dim] < first + rows
                or [n for d, n in enumerate(tensor.shape) if d != dim] != other):
            raise ValueError(f"shard {shard} of {param_name} has shape {tuple(tensor.shape)}, "
                             f"expected {rows * self.tp_size} along dim {dim} and {other} "
                             "in the others")
        param.data.narrow(dim, start, rows).copy_(tensor.narrow(dim, first, rows))

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """Fused q/k/v projection split by heads. When there are fewer kv heads than tp ranks,
    each kv head is replicated on the tp_size // num_kv_heads ranks whose query heads use it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant: QuantMethod = UNQUANTIZED) -> None:
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
                                       self.num_kv_heads * head_dim], bias, quant)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        if shard == 0:
            return super().shard_rows(shard)
        return self.kv_head_start * self.head_dim, self.output_sizes[shard]


def process_loaded_weights(model: nn.Module) -> None:
    """Every checkpoint tensor is in: let each layer's method convert its parameters (and a
    quantized embedding or LM head its own)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant.process_after_loading(module)
        elif hasattr(module, "process_after_loading"):
            module.process_after_loading()
