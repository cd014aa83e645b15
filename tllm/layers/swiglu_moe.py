"""GPT-OSS's mixture of experts: a router with a bias whose top-k logits are softmaxed among
themselves, and experts with biases and a clamped SwiGLU (tllm.kernels.swiglu_moe), kept in
the model's dtype (`SwigluMoEMethod`) or as the checkpoint's MXFP4 blocks
(tllm.layers.quant.mxfp4). Both are MoE methods of `FusedMoE`, so its loading, expert
parallelism and tensor-parallel slicing are the same as Mixtral's.

Parameters, per local expert: w13 [2I, H] (gate rows, then up rows: the checkpoint's
interleaved gate/up columns are split at load), w13_bias [2I], w2 [H, I], w2_bias [H]."""
from __future__ import annotations

import torch
from torch import nn

from tllm.kernels.moe_routing import MoeRouting, route_experts
from tllm.kernels.swiglu_moe import swiglu_experts_ref
from tllm.layers.linear import Linear
from tllm.layers.moe import W2, W13, FusedMoE
from tllm.layers.quant.base import QuantConfig

W13_BIAS, W2_BIAS = "w13_bias", "w2_bias"


def select_top_k_softmax(router_logits: torch.Tensor,
                         top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k logits of each token softmaxed among themselves (in float32): (weights
    [T, k] float32, expert ids [T, k])."""
    return route_experts(router_logits, MoeRouting(top_k, topk_first=True))


class SwigluMoEMethod:
    """The experts in the model's dtype, with biases and the clamped SwiGLU."""

    name = "none"

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int,
                       intermediate_size: int) -> None:
        layer.add_expert_param(W13, torch.empty(num_experts, 2 * intermediate_size,
                                                hidden_size), intermediate_dim=0)
        layer.add_expert_param(W13_BIAS, torch.empty(num_experts, 2 * intermediate_size),
                               intermediate_dim=0)
        layer.add_expert_param(W2, torch.empty(num_experts, hidden_size, intermediate_size),
                               intermediate_dim=1)
        layer.add_expert_param(W2_BIAS, torch.empty(num_experts, hidden_size),
                               intermediate_dim=None)

    def process_after_loading(self, layer: FusedMoE) -> None:
        """Nothing to convert."""

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda:
            from tllm.kernels.triton.swiglu_moe import swiglu_experts_triton
            return swiglu_experts_triton(
                hidden, layer.w13_weight, layer.w13_bias, layer.w2_weight,
                layer.w2_bias if layer.tp_rank == 0 else None, topk_weights, topk_ids,
                self.alpha, self.limit, layer.expert_start)

        def expert(e: int):
            return (layer.w13_weight[e], layer.w13_bias[e], layer.w2_weight[e],
                    down_bias(layer, e))
        return swiglu_experts_ref(hidden, expert, layer.num_local_experts, topk_weights,
                                  topk_ids, self.alpha, self.limit, layer.expert_start)


def down_bias(layer: FusedMoE, expert: int) -> torch.Tensor | None:
    """The down projection's bias, added by one tensor-parallel rank only: the ranks'
    partial outputs are summed after."""
    return layer.w2_bias[expert] if layer.tp_rank == 0 else None


class SwigluMoeBlock(nn.Module):
    """GPT-OSS's feed-forward: the replicated `router` (never quantized) and the experts."""

    def __init__(self, config, quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the "
                             f"model's {num_experts} experts")
        self.router = Linear(config.hidden_size, num_experts, bias=True)
        # transformers before 5.2x hard-codes these (its config has no fields for them)
        alpha = getattr(config, "swiglu_alpha", 1.702)
        limit = getattr(config, "swiglu_limit", 7.0)
        self.experts = FusedMoE(num_experts, config.hidden_size, config.intermediate_size,
                                quant_config, f"{prefix}.experts",
                                method=experts_method(quant_config, alpha, limit, prefix))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = select_top_k_softmax(self.router(hidden), self.top_k)
        return self.experts(hidden, weights, ids)


def experts_method(quant_config: QuantConfig | None, alpha: float, limit: float,
                   prefix: str):
    """Unquantized experts, or the checkpoint's MXFP4 ones; other schemes are refused."""
    if quant_config is None:
        return SwigluMoEMethod(alpha, limit)
    if quant_config.name == "mxfp4":
        from tllm.layers.quant.mxfp4 import Mxfp4SwigluMoEMethod
        return Mxfp4SwigluMoEMethod(alpha, limit)
    raise ValueError(f"{quant_config.name!r} quantization of GPT-OSS experts ({prefix}) is "
                     "not supported: run the checkpoint's MXFP4 or a 16/32-bit one")
