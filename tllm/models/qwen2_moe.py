"""Qwen2-MoE: Qwen2 (q/k/v biases) with sparse MoE feed-forwards (Mixtral's expert loading)
that add a shared expert, an ordinary MLP scaled by a sigmoid gate of its own. Which layers are
sparse: every `decoder_sparse_step`-th one, except those in `mlp_only_layers` (dense MLPs of
`intermediate_size`); the top-k routing weights are renormalised only with `norm_topk_prob`."""
from __future__ import annotations

import torch

from tllm.layers.linear import Linear
from tllm.layers.moe import SparseMoeBlock
from tllm.layers.quant import QuantConfig
from tllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from tllm.models.mixtral import MixtralForCausalLM, num_experts_of
from tllm.models.registry import register_model


def is_sparse_layer(config, layer: int) -> bool:
    """Whether decoder layer `layer` has experts (transformers' rule)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer not in (getattr(config, "mlp_only_layers", None) or ())
            and num_experts_of(config) > 0 and (layer + 1) % step == 0)


def routed_expert_args(config) -> dict:
    """SparseMoeBlock's shape and routing arguments from a Qwen MoE config."""
    return dict(hidden_size=config.hidden_size, num_experts=num_experts_of(config),
                top_k=config.num_experts_per_tok,
                intermediate_size=config.moe_intermediate_size,
                renormalize=bool(getattr(config, "norm_topk_prob", False)))


class Qwen2MoeSparseBlock(SparseMoeBlock):
    """Routed experts plus sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

    def __init__(self, config, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__(**routed_expert_args(config), quant_config=quant_config,
                         prefix=prefix)
        self.shared_expert = LlamaMLP(config, quant_config, f"{prefix}.shared_expert",
                                      intermediate_size=config.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(config.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return super().forward(hidden) + shared


class Qwen2MoeAttention(LlamaAttention):
    def __init__(self, config, *args, **kwargs) -> None:
        self.qkv_bias = getattr(config, "qkv_bias", True)  # read by LlamaAttention
        super().__init__(config, *args, **kwargs)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2MoeAttention

    def make_mlp(self, config, quant_config: QuantConfig | None, prefix: str):
        if is_sparse_layer(config, self.layer_index(prefix.removesuffix(".mlp"))):
            return self.sparse_block(config, quant_config, prefix)
        return LlamaMLP(config, quant_config, prefix)

    def sparse_block(self, config, quant_config: QuantConfig | None, prefix: str):
        return Qwen2MoeSparseBlock(config, quant_config, prefix)


@register_model("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(MixtralForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer
