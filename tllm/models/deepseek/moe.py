"""DeepSeek's feed-forward blocks: a float32 router with grouped top-k routing
(tllm.layers.grouped_topk), routed experts (FusedMoE) and always-on shared experts (one MLP of
n_shared_experts x moe_intermediate_size). Which layers have experts: from
`first_k_dense_replace` on, every `moe_layer_freq`-th (the others are dense MLPs of
`intermediate_size`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tllm.layers.grouped_topk import GroupedRouting, grouped_topk
from tllm.layers.moe import FusedMoE
from tllm.layers.quant import QuantConfig
from tllm.models.llama import LlamaMLP


def is_moe_layer(config, layer: int) -> bool:
    """DeepSeek's rule for which decoder layers are sparse."""
    return (bool(getattr(config, "n_routed_experts", None))
            and layer >= (getattr(config, "first_k_dense_replace", 0) or 0)
            and layer % (getattr(config, "moe_layer_freq", 1) or 1) == 0)


def v3_routing(config) -> GroupedRouting:
    """DeepSeek-V3's: sigmoid scores (a config may say otherwise in `scoring_func`), the
    correction bias, top-2-sum group scores, renormalise then scale."""
    num_groups = getattr(config, "n_group", None) or 1
    return GroupedRouting(
        top_k=config.num_experts_per_tok, num_groups=num_groups,
        topk_group=getattr(config, "topk_group", None) or num_groups,
        scoring=getattr(config, "scoring_func", None) or "sigmoid",
        renormalize=bool(getattr(config, "norm_topk_prob", True)),
        scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0))


def v2_routing(config) -> GroupedRouting:
    """DeepSeek-V2's: softmax scores; `group_limited_greedy` picks groups by their best
    expert (`greedy`: one group); renormalised weights are not scaled (V2's own rule)."""
    method = getattr(config, "topk_method", None) or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method {method!r}: DeepseekV2ForCausalLM supports greedy and "
                         "group_limited_greedy")
    grouped = method == "group_limited_greedy"
    num_groups = (getattr(config, "n_group", None) or 1) if grouped else 1
    return GroupedRouting(
        top_k=config.num_experts_per_tok, num_groups=num_groups,
        topk_group=(getattr(config, "topk_group", None) or num_groups) if grouped else 1,
        scoring=getattr(config, "scoring_func", None) or "softmax",
        renormalize=bool(getattr(config, "norm_topk_prob", False))
        and config.num_experts_per_tok > 1,
        scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
        scale_after_renormalize=False)


class DeepseekRouter(nn.Module):
    """The router's weight [experts, hidden] and, with `has_bias`, V3's
    e_score_correction_bias [experts]: float32 whatever the model's dtype, as trained."""

    def __init__(self, hidden_size: int, num_experts: int, has_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        bias = torch.empty(num_experts, dtype=torch.float32) if has_bias else None
        self.e_score_correction_bias = (None if bias is None else
                                        nn.Parameter(bias, requires_grad=False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


class DeepseekMoE(nn.Module):
    def __init__(self, config, routing: GroupedRouting, has_bias: bool,
                 quant_config: QuantConfig | None = None, prefix: str = "mlp") -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        routing.check(num_experts)
        self.routing = routing
        self.gate = DeepseekRouter(config.hidden_size, num_experts, has_bias)
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size,
                                quant_config, f"{prefix}.experts")
        num_shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = None
        if num_shared:
            self.shared_experts = LlamaMLP(
                config, quant_config, f"{prefix}.shared_experts",
                intermediate_size=config.moe_intermediate_size * num_shared)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = grouped_topk(self.gate(hidden), self.routing,
                                    self.gate.e_score_correction_bias)
        out = self.experts(hidden, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out
