"""Quantization methods of linear layers: how a layer stores its weight and multiplies by
it, apart from the layer's shape and tensor-parallel sharding (vLLM's LinearMethod,
TensorRT-LLM's QuantMode).

A method registers the layer's parameters (`create_weights`), each with a `ParamLayout`
that tells the layer how to cut this rank's shard out of a checkpoint tensor; the layer
loads them; the method then turns them into its run-time form (`process_after_loading`)
and multiplies (`apply`). The unquantized method is the model's dtype as it was."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tllm.layers import dense_gemv_dispatch


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter's dims meet the layer's features. `output_dim`/`input_dim` index
    the dims that follow output/input features (None: not split that way); one element along
    them covers `output_units`/`input_units` features (a scale block, a pack of 4-bit values).
    `per_shard` parameters hold one entry per merged projection (q, k, v): per-tensor scales."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_units: int = 1
    input_units: int = 1
    per_shard: bool = False


WEIGHT = ParamLayout()
PER_OUTPUT = ParamLayout(output_dim=0, input_dim=None)    # per-channel scales, biases
PER_SHARD = ParamLayout(output_dim=None, input_dim=None, per_shard=True)


def add_param(layer: nn.Module, name: str, tensor: torch.Tensor, layout: ParamLayout) -> None:
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    layer.param_layouts[name] = layout


class QuantMethod(ABC):
    """How one linear layer stores and multiplies its weight."""

    name = "none"
    # the weight is layer.weight as it is, [out, in] in the model's dtype (the dense GEMV of
    # tllm.layers.dense_gemv_dispatch may multiply by it in place of `apply`)
    plain_weight = False

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       num_shards: int) -> None:
        """Register this rank's (shard-sized) parameters on the layer with `add_param`.
        `num_shards` is the number of merged projections (1 unless q/k/v or gate/up)."""

    def process_after_loading(self, layer: nn.Module) -> None:
        """Every parameter is loaded: convert to the run-time form (quantize, fold scales)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, in_features] times the weight: [tokens, out_features] in x's dtype,
        without bias (the layer adds it, after the all-reduce when row-parallel)."""

    def apply_with_bias(self, layer: nn.Module, x: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
        """`apply` plus the bias; a method whose kernel can add it in its epilogue (one
        launch, not a product and an add) overrides this."""
        out = self.apply(layer, x)
        return out if bias is None else out + bias

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight as the compute dtype sees it [out, in] (for references and tests)."""
        return layer.weight


class UnquantizedMethod(QuantMethod):
    """The weight in the model's dtype."""

    plain_weight = True

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       num_shards: int) -> None:
        add_param(layer, "weight", torch.empty(out_features, in_features), WEIGHT)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.apply_with_bias(layer, x, None)

    def apply_with_bias(self, layer: nn.Module, x: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias in one launch: the GEMV (batch-1 decode, where it wins) or
        F.linear with the bias in cuBLAS's epilogue, as nn.Linear."""
        out = dense_gemv_dispatch.dense_linear(layer, x, bias)
        return F.linear(x, layer.weight, bias) if out is None else out


UNQUANTIZED = UnquantizedMethod()


class QuantConfig(ABC):
    """A model's quantization scheme: which method each linear layer gets. Made from
    `LlmArgs.quantization` or from the checkpoint's own config (tllm.loader.quantization)."""

    name = "none"

    @abstractmethod
    def linear_method(self, prefix: str, shard_names: tuple[str, ...] = ()) -> QuantMethod:
        """The method of the linear layer at `prefix` (our module name, e.g.
        "layers.3.self_attn.qkv_proj"); `shard_names` are the checkpoint projections a
        merged layer holds (("q_proj", "k_proj", "v_proj")), for ignore lists."""

    def kv_cache_scales_in_checkpoint(self) -> bool:
        """Whether the checkpoint carries k_scale / v_scale per attention layer."""
        return False


def linear_method(quant_config: QuantConfig | None, prefix: str,
                  shard_names: tuple[str, ...] = ()) -> QuantMethod:
    return UNQUANTIZED if quant_config is None else quant_config.linear_method(prefix,
                                                                                shard_names)
