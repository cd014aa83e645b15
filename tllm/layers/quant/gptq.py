"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum, as transformers and vLLM read them):
  qweight int32 [in / pack, out]   pack = 32 / bits values of consecutive input features a
                                   word, input pack*r + i in bits i*bits .. (in order)
  qzeros  int32 [groups, out / pack]  zero points, consecutive outputs packed alike
  scales  float16 [groups, out]
  g_idx   int32 [in]               the group of each input feature (act-order: any order)
  w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]
The "gptq" (v1) checkpoint format stores every zero point minus one (AutoGPTQ's packing
subtracts 1, its kernels add it back; GPTQModel's "gptq_v2" stores them as they are), so v1
zeros are read as stored + 1, as vLLM and the exllama kernels do.

Act-order (desc_act) weights are stored sorted by group at load, and the layer gathers x's
features by that order before the product. A row-parallel shard of such a layer would need
other ranks' features: refused with an error. q/k/v (gate/up) share one input, so their
g_idx must be equal to be merged; each projection's is kept to check it."""
from __future__ import annotations

import torch
from torch import nn

from tllm.kernels.woq import pack_factor, unpack_along_last
from tllm.layers.quant.base import ParamLayout, add_param
from tllm.layers.quant.woq import WoqLinearMethod, check_groups


class GptqLinearMethod(WoqLinearMethod):
    name = "gptq"

    def __init__(self, bits: int, group: int, zeros_minus_one: bool) -> None:
        super().__init__(bits, group)
        self.zeros_minus_one = zeros_minus_one
        self.pack = pack_factor(bits)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       num_shards: int) -> None:
        group = check_groups(in_features, out_features, self.group, self.pack, "GPTQ")
        if in_features % self.pack:
            raise ValueError(f"GPTQ: {in_features} input features are not whole words")
        groups = in_features // group
        pack = self.pack
        add_param(layer, "qweight", torch.empty(in_features // pack, out_features,
                                                dtype=torch.int32),
                  ParamLayout(output_dim=1, input_dim=0, input_units=pack))
        add_param(layer, "qzeros", torch.empty(groups, out_features // pack, dtype=torch.int32),
                  ParamLayout(output_dim=1, input_dim=0, output_units=pack, input_units=group))
        add_param(layer, "scales", torch.empty(groups, out_features, dtype=torch.float32),
                  ParamLayout(output_dim=1, input_dim=0, input_units=group))
        add_param(layer, "g_idx", torch.empty(num_shards, in_features, dtype=torch.int32),
                  ParamLayout(output_dim=None, input_dim=1, per_shard=True))

    def runtime_form(self, layer):
        bits = self.bits
        q = unpack_along_last(layer.qweight.data.t().contiguous(), bits)    # [out, in]
        zeros = unpack_along_last(layer.qzeros.data, bits)                   # [groups, out]
        if self.zeros_minus_one:
            zeros = zeros + 1
        scales = layer.scales.data
        k = q.shape[1]
        group = k if self.group == -1 else self.group
        perm = self._act_order(layer, k, group)
        if perm is not None:
            q = q.index_select(1, perm)
        return q, scales, zeros, perm

    def _act_order(self, layer: nn.Module, k: int, group: int) -> torch.Tensor | None:
        """None when features are in group order; else the order that sorts them by group
        (each group must then hold `group` features, in this rank's whole range)."""
        g_idx = layer.g_idx.data
        if not bool((g_idx == g_idx[0]).all()):
            raise ValueError("GPTQ: the merged projections of this layer carry different g_idx "
                             "(act-order permutations); they cannot share one input order")
        g_idx = g_idx[0].long()
        first = int(g_idx.min())
        in_order = torch.arange(k, device=g_idx.device) // group + first
        if torch.equal(g_idx, in_order):  # (first > 0: a row-parallel shard's own groups)
            return None
        perm = torch.argsort(g_idx, stable=True)
        if first != 0 or not torch.equal(g_idx[perm], in_order):
            tp = getattr(layer, "tp_size", 1)
            raise ValueError("GPTQ act-order (desc_act) weights: this layer's input features "
                             f"do not hold whole groups of {group}"
                             + (f" on each of the {tp} tensor-parallel ranks (a row-parallel "
                                "shard of an act-order layer needs other ranks' features); "
                                "run with tensor_parallel_size=1 or a desc_act=false checkpoint"
                                if tp > 1 else ""))
        return perm.to(torch.int32)
