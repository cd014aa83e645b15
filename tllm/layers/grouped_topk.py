"""DeepSeek's routing: experts in `num_groups` groups, each token choosing its `topk_group`
best groups first and its top_k experts among them only.

- DeepSeek-V3 (and Kimi-K2, Moonlight): sigmoid scores; the choice (not the weights) adds
  `e_score_correction_bias` (the auxiliary-loss-free balancing bias); a group scores the sum
  of its best two; the chosen scores are renormalised (`norm_topk_prob`) and then scaled by
  `routed_scaling_factor`.
- DeepSeek-V2: softmax scores; a group scores its best expert (`group_limited_greedy`; plain
  `greedy` has one group); weights are renormalised when `norm_topk_prob` (V2's own code
  then skips the scaling), else scaled by `routed_scaling_factor`.
Everything in float32, as the reference implementations do; the routing itself (one Triton
launch on CUDA) is tllm.kernels.moe_routing's, shared with every MoE block."""
from __future__ import annotations

import torch

from tllm.kernels.moe_routing import MoeRouting, route_experts

GroupedRouting = MoeRouting  # the DeepSeek-shaped fields of the one routing description


def grouped_topk(router_logits: torch.Tensor, routing: MoeRouting,
                 correction_bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k])."""
    return route_experts(router_logits, routing, correction_bias)
