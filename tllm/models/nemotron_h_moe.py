"""Nemotron-H's MoE block (Nemotron 3's "moe" layers): DeepSeek-V3-style routing (sigmoid
scores, the correction bias in the choice, groups, renormalised and scaled weights) over
non-gated squared-ReLU experts, an optional latent projection around the experts, and a
shared expert on the block's input.

The experts run on tllm's fused MoE kernels with a squared-ReLU, non-gated first GEMM
(tllm.kernels.moe.relu2_experts: no host sync, so CUDA graphs hold them), a torch loop over
the experts chosen on a CPU."""
from __future__ import annotations

import re

import torch
from torch import nn

from tllm.kernels.moe import relu2_experts
from tllm.layers.grouped_topk import GroupedRouting, grouped_topk
from tllm.layers.linear import Linear, _copy_checked

# a checkpoint's per-expert tensor: "experts.<e>.up_proj.weight"
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


class NemotronHExperts(nn.Module):
    """Every expert's up [E, I, D] and down [E, D, I] weights."""

    def __init__(self, num_experts: int, dim: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.expert_load_hook = None   # moe_load_stats (tllm/layers/moe_load.py)
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, dim),
                                    requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate_size),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        if self.expert_load_hook is not None:
            self.expert_load_hook(ids)
        return relu2_experts(x, self.up_proj, self.down_proj, weights, ids)


class NemotronHMoE(nn.Module):
    def __init__(self, config, make_mlp) -> None:
        super().__init__()
        num_experts, hidden = config.n_routed_experts, config.hidden_size
        self.routing = GroupedRouting(
            top_k=config.num_experts_per_tok, num_groups=config.n_group,
            topk_group=config.topk_group, scoring="sigmoid",
            renormalize=config.norm_topk_prob, scaling_factor=config.routed_scaling_factor)
        self.routing.check(num_experts)
        self.gate = nn.Module()     # the router, kept in float32 as the reference does
        self.gate.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32),
                                        requires_grad=False)
        self.gate.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
        latent = getattr(config, "moe_latent_size", None)
        bias = getattr(config, "mlp_bias", False)
        if latent is not None:
            self.fc1_latent_proj = Linear(hidden, latent, bias=bias)
            self.fc2_latent_proj = Linear(latent, hidden, bias=bias)
        self.experts = NemotronHExperts(num_experts, latent or hidden,
                                        config.moe_intermediate_size)
        self.shared_experts = make_mlp(config, config.moe_shared_expert_intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden.float() @ self.gate.weight.t()
        weights, ids = grouped_topk(logits, self.routing, self.gate.e_score_correction_bias)
        x = self.fc1_latent_proj(hidden) if hasattr(self, "fc1_latent_proj") else hidden
        x = self.experts(x, weights, ids)
        if hasattr(self, "fc2_latent_proj"):
            x = self.fc2_latent_proj(x)
        return x + self.shared_experts(hidden)


def load_per_expert(model: nn.Module, name: str, tensor: torch.Tensor) -> str | None:
    """Copy `experts.<e>.up_proj.weight` (as checkpoints store experts) into row e of the
    stacked parameter; returns the parameter's name, or None for any other tensor."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, which = match.groups()
    param = model.get_parameter(f"{prefix}.{which}")
    _copy_checked(param.data[int(expert)], tensor, name)
    return f"{prefix}.{which}"
