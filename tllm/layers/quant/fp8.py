"""FP8 W8A8: e4m3 weights with per-channel, per-tensor or 128x128-block scales, and
activations quantized at run time (per token, "dynamic") or with a checkpoint's per-tensor
input scale ("static").

At run time every scheme but block scales is one form: an fp8 weight [N, K] with a float32
scale per output channel [N, 1] (per-tensor scales are spread over their rows after loading),
so one GEMM path serves them all. The kernels (tllm.kernels.fp8_ops) run cuBLASLt /
Triton on CUDA and the exact torch emulation elsewhere."""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Literal

import torch
from torch import nn

from tllm.kernels import fp8 as ref
from tllm.kernels import fp8_ops
from tllm.layers.moe import UNQUANTIZED_MOE
from tllm.layers.quant.base import (PER_OUTPUT, PER_SHARD, WEIGHT, ParamLayout, QuantConfig,
                                    QuantMethod, UNQUANTIZED, add_param)
from tllm.layers.quant.fp8_moe import Fp8MoEMethod

WeightScheme = Literal["channel", "tensor", "block"]


@dataclass(frozen=True)
class Fp8Scheme:
    weight: WeightScheme = "channel"
    block: tuple[int, int] = (128, 128)            # (rows, columns) of a weight-scale block
    activation: Literal["dynamic", "static"] = "dynamic"
    # False: the checkpoint holds the model dtype and weights are quantized as they load
    checkpoint_is_fp8: bool = True


class Fp8LinearMethod(QuantMethod):
    name = "fp8"

    def __init__(self, scheme: Fp8Scheme) -> None:
        if scheme.weight == "block" and scheme.activation == "static":
            raise ValueError("fp8 block-scaled weights take dynamic activations only")
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       num_shards: int) -> None:
        scheme = self.scheme
        if not scheme.checkpoint_is_fp8:  # quantized once loaded
            add_param(layer, "weight", torch.empty(out_features, in_features), WEIGHT)
            return
        add_param(layer, "weight",
                  torch.empty(out_features, in_features, dtype=ref.FP8_DTYPE), WEIGHT)
        if scheme.weight == "channel":
            add_param(layer, "weight_scale",
                      torch.empty(out_features, 1, dtype=torch.float32), PER_OUTPUT)
        elif scheme.weight == "tensor":
            add_param(layer, "weight_scale", torch.empty(num_shards, dtype=torch.float32),
                      PER_SHARD)
        else:
            bn, bk = scheme.block
            add_param(layer, "weight_scale_inv",
                      torch.empty(-(-out_features // bn), -(-in_features // bk),
                                  dtype=torch.float32),
                      ParamLayout(output_units=bn, input_units=bk))
        if scheme.activation == "static":
            add_param(layer, "input_scale", torch.empty(num_shards, dtype=torch.float32),
                      PER_SHARD)

    def process_after_loading(self, layer: nn.Module) -> None:
        scheme = self.scheme
        if not scheme.checkpoint_is_fp8:
            weight, scale = ref.quantize_per_channel(layer.weight.data)
            _replace(layer, "weight", weight)
            _replace(layer, "weight_scale", scale)
        elif scheme.weight == "tensor":  # one scale per merged shard -> one per row
            sizes = getattr(layer, "output_sizes", [layer.weight.shape[0]])
            rows = layer.weight_scale.data.repeat_interleave(
                torch.tensor(sizes, device=layer.weight.device))
            _replace(layer, "weight_scale", rows[:, None].contiguous())
        if scheme.activation == "static":  # shards share one input: the largest scale
            _replace(layer, "input_scale", layer.input_scale.data.max().reshape(()))

    def apply(self, layer: nn.Module, x: torch.Tensor | ref.QuantizedActivation) -> torch.Tensor:
        """x [..., in] in the model dtype, or quantized per token already by the op before
        (only when `input_quantization` asked for it)."""
        shape = x.shape
        if isinstance(x, ref.QuantizedActivation):
            if self.scheme.weight == "block" or self.scheme.activation == "static":
                raise ValueError("fp8: a per-token quantized input needs per-channel weights "
                                 "and dynamic activations")
            x2 = ref.QuantizedActivation(x.q.reshape(-1, shape[-1]),
                                         x.scale.reshape(-1, 1), x.dtype)
            out = fp8_ops.fp8_linear(x2, layer.weight, layer.weight_scale)
            return out.reshape(*shape[:-1], out.shape[-1])
        x2 = x.reshape(-1, shape[-1])
        if self.scheme.weight == "block":
            out = fp8_ops.block_fp8_linear(x2, layer.weight, layer.weight_scale_inv,
                                           self.scheme.block)
        else:
            input_scale = layer.input_scale if self.scheme.activation == "static" else None
            out = fp8_ops.fp8_linear(x2, layer.weight, layer.weight_scale, input_scale)
        return out.reshape(*shape[:-1], out.shape[-1])

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        if self.scheme.weight == "block":
            return ref.dequantize_blocks(layer.weight, layer.weight_scale_inv, self.scheme.block)
        return layer.weight.float() * layer.weight_scale.float()

    def input_quantization(self, layer: nn.Module, x: torch.Tensor) -> torch.dtype | None:
        """fp8 when this layer would quantize x per token itself (CUDA, above the small-M
        kernel's rows, per-channel weights, dynamic activations): the op producing x then
        quantizes in its own kernel and hands over a QuantizedActivation. None otherwise."""
        if self.scheme.weight == "block" or self.scheme.activation == "static":
            return None
        if not isinstance(getattr(layer, "weight", None), torch.Tensor) \
                or layer.weight.dtype != ref.FP8_DTYPE:
            return None  # not loaded and converted yet
        n, k = layer.weight.shape
        return ref.FP8_DTYPE if fp8_ops.takes_quantized_input(x, n, k) else None


def input_quantization(linear: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The dtype the linear layer `linear` wants its input x quantized to (per token) by the
    op before it, fused into that op's kernel; None: hand x over as it is."""
    method = getattr(linear, "quant", None)
    if isinstance(method, Fp8LinearMethod):
        return method.input_quantization(linear, x)
    return None


def _replace(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Swap a parameter for its run-time form (a new dtype or shape)."""
    layout = layer.param_layouts.get(name, PER_OUTPUT)
    if hasattr(layer, name):
        delattr(layer, name)
    add_param(layer, name, tensor, layout)


@dataclass(frozen=True)
class Fp8Config(QuantConfig):
    """FP8 for every linear layer but those an ignore pattern names (checkpoint names, e.g.
    "lm_head", "re:.*mlp.gate$", "model.layers.0.*"); the LM head is never quantized here.
    `param_aliases` maps a format's names of a linear layer's tensors to the method's
    (("weight_scale", "weight_scale_inv"): compressed-tensors' block scales)."""

    scheme: Fp8Scheme = Fp8Scheme()
    ignore: tuple[str, ...] = field(default_factory=tuple)
    has_kv_scales: bool = False
    param_aliases: tuple[tuple[str, str], ...] = ()
    name = "fp8"

    def linear_method(self, prefix: str, shard_names: tuple[str, ...] = ()) -> QuantMethod:
        names = _checkpoint_names(prefix, shard_names)
        if any(_matches(pattern, name) for pattern in self.ignore for name in names):
            return UNQUANTIZED
        return Fp8LinearMethod(self.scheme)

    def moe_method(self, prefix: str):
        """The experts at `prefix` (e.g. "layers.3.mlp.experts") in fp8, unless ignored."""
        names = _checkpoint_names(prefix, ())
        if any(_matches(pattern, name) for pattern in self.ignore for name in names):
            return UNQUANTIZED_MOE
        return Fp8MoEMethod(self.scheme)

    def kv_cache_scales_in_checkpoint(self) -> bool:
        return self.has_kv_scales


def _checkpoint_names(prefix: str, shard_names: tuple[str, ...]) -> list[str]:
    """The checkpoint's names for our layer: with and without "model.", merged layers by the
    projections they hold."""
    parent, _, leaf = prefix.rpartition(".")
    leaves = shard_names or (leaf,)
    bases = [f"{parent}.{name}" if parent else name for name in leaves]
    return bases + [f"model.{b}" for b in bases]


def _matches(pattern: str, name: str) -> bool:
    import re
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return name == pattern or fnmatch(name, pattern) or name.endswith("." + pattern)
