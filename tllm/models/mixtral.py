"""Mixtral: the Llama decoder with a sparse mixture-of-experts feed-forward (top-2 of 8 experts,
the top-2 softmax renormalised). Also the base of the Qwen MoE models: their expert weights
load the same way, from either checkpoint layout:
- one tensor per expert and projection: `block_sparse_moe.experts.N.w1/w3/w2` (Mixtral) or
  `mlp.experts.N.gate_proj/up_proj/down_proj` (Qwen; what transformers 5.24 `save_pretrained`
  still writes);
- the stacked tensors of transformers 5's modules: `mlp.experts.gate_up_proj` [E, 2I, H]
  and `mlp.experts.down_proj` [E, H, I].
An FP8 checkpoint's per-expert scales (`experts.N.w1.weight_scale[_inv]`) load next to their
weights (tllm.layers.quant.fp8_moe)."""
from __future__ import annotations

import re
from typing import Iterable

import torch

from tllm.layers.moe import W2, W13, FusedMoE, SparseMoeBlock
from tllm.layers.quant import QuantConfig
from tllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tllm.models.registry import register_model

_EXPERT_TENSOR = re.compile(
    r"layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.(\w+)\.weight|(gate_up_proj|down_proj))")
# one expert's checkpoint projection -> (stacked parameter, shard)
EXPERT_PROJECTIONS = {"w1": (W13, 0), "gate_proj": (W13, 0), "w3": (W13, 1),
                      "up_proj": (W13, 1), "w2": (W2, None), "down_proj": (W2, None)}
# an FP8 checkpoint's scale of one expert's projection
_EXPERT_SCALE = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\."
                           r"(weight_scale_inv|weight_scale|input_scale|activation_scale)")
STACKED_PROJECTIONS = {"gate_up_proj": W13, "down_proj": W2}


def num_experts_of(config) -> int:
    """The config's expert count (Mixtral names it num_local_experts, Qwen num_experts)."""
    count = getattr(config, "num_experts", None)
    return count if count is not None else config.num_local_experts


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, quant_config: QuantConfig | None, prefix: str):
        return SparseMoeBlock(config.hidden_size, num_experts_of(config),
                              config.num_experts_per_tok, config.intermediate_size,
                              renormalize=True, quant_config=quant_config, prefix=prefix)


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors go into the stacked experts here; everything else loads as in
        Llama (`block_sparse_moe` is our `mlp`)."""
        expert_keys: set[str] = set()

        def other_weights():
            for name, tensor in weights:
                name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
                scale = _EXPERT_SCALE.fullmatch(name)
                match = _EXPERT_TENSOR.fullmatch(name)
                if scale is not None:
                    expert_keys.update(self._load_expert_scale(name, scale, tensor))
                elif match is None:
                    yield name, tensor
                else:
                    expert_keys.update(self._load_expert_tensor(name, match, tensor))

        loaded = super().load_weights(other_weights())
        return loaded | expert_keys

    def _experts_of(self, name: str, layer: int, projection: str,
                    projections: dict) -> FusedMoE:
        experts = getattr(self.layers[layer].mlp, "experts", None)
        if not isinstance(experts, FusedMoE) or projection not in projections:
            raise ValueError(f"checkpoint tensor {name!r} has no place in "
                             f"{type(self).__name__}")
        return experts

    def _load_expert_scale(self, name: str, match: re.Match, tensor: torch.Tensor) -> set[str]:
        """`w13_weight_scale` etc. of one expert; static input scales are not used (the
        FP8 experts quantize their activations per token at run time)."""
        layer = int(match[1])
        leaf = dict(getattr(self.quant_config, "param_aliases", ())).get(match[4], match[4])
        if layer not in self.stage_layers or leaf == "input_scale":
            return set()
        experts = self._experts_of(name, layer, match[3], EXPERT_PROJECTIONS)
        param, shard = EXPERT_PROJECTIONS[match[3]]
        keys = experts.load_expert(param + leaf.removeprefix("weight"), int(match[2]), shard,
                                   tensor)
        return {f"layers.{layer}.mlp.experts.{key}" for key in keys}

    def _load_expert_tensor(self, name: str, match: re.Match, tensor: torch.Tensor) -> set[str]:
        layer = int(match[1])
        if layer not in self.stage_layers:
            return set()
        projection = match[4] or match[3]
        experts = self._experts_of(name, layer, projection,
                                   STACKED_PROJECTIONS if match[4] else EXPERT_PROJECTIONS)
        if match[4]:
            keys = experts.load_stacked(STACKED_PROJECTIONS[projection], tensor)
        else:
            param, shard = EXPERT_PROJECTIONS[projection]
            keys = experts.load_expert(param, int(match[2]), shard, tensor)
        return {f"layers.{layer}.mlp.experts.{key}" for key in keys}

    def expected_weights(self) -> set[str]:
        """Llama's, with each MoE layer's stacked parameters counted per expert and shard."""
        expected = super().expected_weights()
        for name, module in self.named_modules():
            if isinstance(module, FusedMoE):
                expected = {k for k in expected if not k.startswith(f"{name}.")}
                expected |= {f"{name}.{key}" for key in module.expected_keys()}
        return expected
