"""DeepSeek's routing: experts in `num_groups` groups, each token choosing its `topk_group`
best groups first and its top_k experts among them only.

- DeepSeek-V3 (and Kimi-K2, Moonlight): sigmoid scores; the choice (not the weights) adds
  `e_score_correction_bias` (the auxiliary-loss-free balancing bias); a group scores the sum
  of its best two; the chosen scores are renormalised (`norm_topk_prob`) and then scaled by
  `routed_scaling_factor`.
- DeepSeek-V2: softmax scores; a group scores its best expert (`group_limited_greedy`; plain
  `greedy` has one group); weights are renormalised when `norm_topk_prob` (V2's own code
  then skips the scaling), else scaled by `routed_scaling_factor`.
Everything in float32, as the reference implementations do."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupedRouting:
    top_k: int
    num_groups: int = 1
    topk_group: int = 1
    scoring: str = "softmax"          # "softmax" (V2) or "sigmoid" (V3)
    renormalize: bool = False
    scaling_factor: float = 1.0
    scale_after_renormalize: bool = True  # V3 scales renormalised weights; V2 does not

    def check(self, num_experts: int) -> None:
        """ValueError naming the config field that does not fit `num_experts`."""
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {self.scoring!r}: softmax or sigmoid only")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the "
                             f"model's {num_experts} experts")
        if self.num_groups < 1 or num_experts % self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must divide the model's "
                             f"{num_experts} experts")
        if not 1 <= self.topk_group <= self.num_groups:
            raise ValueError(f"topk_group ({self.topk_group}) must be between 1 and n_group "
                             f"({self.num_groups})")


def grouped_topk(router_logits: torch.Tensor, routing: GroupedRouting,
                 correction_bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    logits = router_logits.float()
    scores = logits.sigmoid() if routing.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.topk_group < routing.num_groups:
        choice = _keep_best_groups(choice, routing, by_top2=correction_bias is not None)
    ids = choice.topk(routing.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if not routing.scale_after_renormalize:
            return weights, ids
    return weights * routing.scaling_factor, ids


def _keep_best_groups(choice: torch.Tensor, routing: GroupedRouting,
                      by_top2: bool) -> torch.Tensor:
    """The choice scores with the experts outside each token's best groups at -inf."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, routing.num_groups, -1)
    group_scores = (grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1) if by_top2
                    else grouped.max(dim=-1).values)
    best = group_scores.topk(routing.topk_group, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, num_experts)
