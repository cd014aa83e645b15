"""AWQ checkpoints, GEMM packing (AutoAWQ's WQLinear_GEMM, as transformers and vLLM read it):
  qweight int32 [in, out / 8]   eight 4-bit values of consecutive output features a word,
                                in AWQ's order: output 8c + AWQ_ORDER[i] in bits 4i .. 4i+3
  qzeros  int32 [in / g, out / 8]  the zero points, packed alike
  scales  float16 [in / g, out]
  w[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]
Sharded along either dim through the ParamLayouts (output units of 8 packed features, input
units of one group), then repacked into tllm.kernels.woq's run-time form."""
from __future__ import annotations

import torch
from torch import nn

from tllm.kernels.woq import unpack_along_last
from tllm.layers.quant.base import ParamLayout, add_param
from tllm.layers.quant.woq import WoqLinearMethod, check_groups

BITS = 4
PACK = 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)       # bit-field i holds output 8c + AWQ_ORDER[i]


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] in AWQ's order -> int32 values [rows, cols]."""
    fields = unpack_along_last(packed, BITS).reshape(*packed.shape, PACK)
    values = torch.empty_like(fields)
    values[..., list(AWQ_ORDER)] = fields
    return values.reshape(packed.shape[0], -1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_awq (for tests and tools): values [rows, cols] in 0..15."""
    from tllm.kernels.woq import pack_along_last
    grouped = values.reshape(values.shape[0], -1, PACK)[..., list(AWQ_ORDER)]
    return pack_along_last(grouped.reshape(values.shape[0], -1), BITS)


class AwqLinearMethod(WoqLinearMethod):
    name = "awq"

    def __init__(self, group: int) -> None:
        super().__init__(BITS, group)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       num_shards: int) -> None:
        group = check_groups(in_features, out_features, self.group, PACK, "AWQ")
        groups = in_features // group
        add_param(layer, "qweight", torch.empty(in_features, out_features // PACK,
                                                dtype=torch.int32),
                  ParamLayout(output_dim=1, input_dim=0, output_units=PACK))
        add_param(layer, "qzeros", torch.empty(groups, out_features // PACK, dtype=torch.int32),
                  ParamLayout(output_dim=1, input_dim=0, output_units=PACK, input_units=group))
        add_param(layer, "scales", torch.empty(groups, out_features, dtype=torch.float32),
                  ParamLayout(output_dim=1, input_dim=0, input_units=group))

    def runtime_form(self, layer):
        q = unpack_awq(layer.qweight.data).t()                  # [out, in]
        zeros = unpack_awq(layer.qzeros.data)                   # [in / g, out]
        return q, layer.scales.data, zeros, None
