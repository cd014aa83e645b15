"""Weight-only int4 / int8 linear layers (W4A16, W8A16): the base of the AWQ and GPTQ
checkpoint methods (awq.py, gptq.py) and the online round-to-nearest quantization of a 16/32-bit
checkpoint (`quantization="int4_awq"` / `"int8_wo"`, for benchmarks).

Each method registers the parameters its checkpoint format stores (`create_weights`), and
after loading repacks them into the one run-time form of tllm.kernels.woq (qweight int32
[N, K / pack] interleaved along K, scales and zeros [K / group, N]), multiplied by the Triton
kernels on CUDA and by the dequantize-then-matmul reference elsewhere. The weights stay
packed on the device; scales and zeros are float16 on the GPU (as AWQ / GPTQ ship them) and
float32 on the CPU."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tllm.kernels import woq
from tllm.kernels.woq_ops import woq_linear
from tllm.layers.quant.base import (WEIGHT, ParamLayout, QuantConfig, QuantMethod,
                                    UNQUANTIZED, add_param)

ONLINE_GROUP = 128


def replace_param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Swap a parameter for its run-time form (a new dtype or shape)."""
    if hasattr(layer, name):
        delattr(layer, name)
    add_param(layer, name, tensor, ParamLayout(output_dim=None, input_dim=None))


def check_groups(in_features: int, out_features: int, group: int, pack_out: int,
                 what: str) -> int:
    """The layer's group size (-1: one group over the layer's inputs). A tensor-parallel shard
    must hold whole groups and whole packed words; the error says which."""
    group = in_features if group == -1 else group
    if group <= 0 or group % 16:
        raise ValueError(f"{what}: group_size {group} is not supported (a multiple of 16, "
                         "or -1 for one group per output row)")
    if in_features % group:
        raise ValueError(f"{what}: this layer's {in_features} input features (its tensor-"
                         f"parallel shard, if split) are not whole groups of {group}; use a "
                         "tensor_parallel_size that keeps groups whole")
    if out_features % pack_out:
        raise ValueError(f"{what}: this layer's {out_features} output features (its tensor-"
                         f"parallel shard, if split) are not whole packed words of {pack_out}")
    return group


class WoqLinearMethod(QuantMethod):
    """The run-time form and product; subclasses register their checkpoint's parameters and
    turn them into it (`runtime_form`)."""

    name = "woq"

    def __init__(self, bits: int, group: int) -> None:
        woq.pack_factor(bits)
        self.bits, self.group = bits, group
        self.layout: woq.WoqLayout | None = None   # set once packed

    def runtime_form(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor,
                                                       torch.Tensor, torch.Tensor | None]:
        """(values q [N, K] uint8/int32, scales [K / group, N], zeros [K / group, N],
        perm [K] or None): the weight as w[n, k] = (q - z) * s in stored feature order,
        x gathered by perm first."""
        raise NotImplementedError

    def process_after_loading(self, layer: nn.Module) -> None:
        q, scales, zeros, perm = self.runtime_form(layer)
        device = q.device
        n, k = q.shape
        group = check_groups(k, n, self.group, 1, type(self).__name__)
        self.layout = woq.WoqLayout(self.bits, group, woq.interleave_words(k, self.bits))
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        for name in list(layer.param_layouts):
            if name != "bias":
                delattr(layer, name)
                del layer.param_layouts[name]
        replace_param(layer, "qweight", woq.pack_rows(q.to(torch.int32), self.layout))
        replace_param(layer, "scales", scales.to(dtype).contiguous())
        replace_param(layer, "zeros", zeros.to(dtype).contiguous())
        layer.perm = None if perm is None else perm.to(device=device, dtype=torch.int64)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return woq_linear(x, layer.qweight, layer.scales, layer.zeros, self.layout, layer.perm)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """float32 [out, in] in the checkpoint's feature order."""
        w = woq.dequantize(layer.qweight, layer.scales, layer.zeros, self.layout)
        if layer.perm is None:
            return w
        return w[:, torch.argsort(layer.perm)]


class OnlineWoqMethod(WoqLinearMethod):
    """A 16/32-bit checkpoint's weight quantized as it loads: round-to-nearest, asymmetric
    (AWQ's zero points), groups of 128 input features (or all of them where fewer)."""

    name = "woq_online"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       num_shards: int) -> None:
        add_param(layer, "weight", torch.empty(out_features, in_features), WEIGHT)
        if in_features % 16:
            raise ValueError(f"weight-only int{self.bits}: {in_features} input features are "
                             "not a multiple of 16")

    def runtime_form(self, layer):
        weight = layer.weight.data
        k = weight.shape[1]
        self.group = ONLINE_GROUP if k % ONLINE_GROUP == 0 else k
        q, scales, zeros = woq.quantize_rtn(weight, self.bits, self.group)
        return q, scales, zeros, None


@dataclass(frozen=True)
class WoqConfig(QuantConfig):
    """Weight-only quantization of every linear layer but those `is_ignored` names (its
    checkpoint names, e.g. "model.layers.0.mlp.gate_proj"); the LM head and embedding stay
    in the model dtype. `make_method` builds one layer's method."""

    name: str = "woq"
    make_method: Callable[[], QuantMethod] = field(default=lambda: OnlineWoqMethod(4, 128))
    is_ignored: Callable[[str], bool] = field(default=lambda name: False)
    lm_head_bits: int | None = None     # 8: the LM head weight-only int8 too (online only)

    def lm_head_layer(self, vocab_size: int, hidden_size: int, tied: bool) -> nn.Module | None:
        """The int8 LM head where asked for (its own weight quantized; a tied embedding keeps
        the float one), else None: the model dtype's."""
        if self.lm_head_bits is None:
            return None
        from tllm.layers.quant.woq_head import WoqLMHead
        return WoqLMHead(vocab_size, hidden_size, self.lm_head_bits)

    def linear_method(self, prefix: str, shard_names: tuple[str, ...] = ()) -> QuantMethod:
        names = checkpoint_names(prefix, shard_names)
        ignored = [self.is_ignored(n) for n in names]
        if all(ignored):
            return UNQUANTIZED
        if any(ignored):
            raise ValueError(f"{self.name}: the projections {', '.join(names)} of merged layer "
                             f"{prefix} are quantized differently (some are not)")
        return self.make_method()


def checkpoint_names(prefix: str, shard_names: tuple[str, ...]) -> list[str]:
    """The checkpoint's names (with "model.") of the projections our layer at `prefix` holds."""
    parent, _, leaf = prefix.rpartition(".")
    leaves = shard_names or (leaf,)
    return [f"model.{parent}.{name}" if parent else f"model.{name}" for name in leaves]


ONLINE_SCHEMES = {"int4_awq": (4, None), "int8_wo": (8, None), "int4_awq_int8_head": (4, 8)}


def online_config(requested: str) -> WoqConfig:
    """quantization="int4_awq" (4-bit, AWQ-style zero points), "int8_wo" (8-bit) or
    "int4_awq_int8_head" (4-bit layers, int8 LM head: off by default, as TensorRT-LLM and
    vLLM keep the head in the model dtype; greedy tokens may part from int4_awq's late)."""
    bits, head_bits = ONLINE_SCHEMES[requested]
    return WoqConfig(name=requested, make_method=lambda: OnlineWoqMethod(bits, ONLINE_GROUP),
                     lm_head_bits=head_bits)
