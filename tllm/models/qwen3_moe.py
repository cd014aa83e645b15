"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, no biases) with Qwen2-MoE's choice of
sparse layers and no shared expert (e.g. top-8 of 128 experts, `norm_topk_prob`)."""
from __future__ import annotations

from tllm.layers.moe import SparseMoeBlock
from tllm.layers.quant import QuantConfig
from tllm.models.mixtral import MixtralForCausalLM
from tllm.models.qwen2_moe import Qwen2MoeDecoderLayer, routed_expert_args
from tllm.models.qwen3 import Qwen3Attention
from tllm.models.registry import register_model


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = Qwen3Attention

    def sparse_block(self, config, quant_config: QuantConfig | None, prefix: str):
        return SparseMoeBlock(**routed_expert_args(config), quant_config=quant_config,
                              prefix=prefix)


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(MixtralForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
