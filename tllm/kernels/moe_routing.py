"""Mixture-of-experts routing: router logits [T, E] -> each token's top-k weights [T, k]
float32 and expert ids [T, k]. Every MoE block routes through `route_experts`: one Triton
launch on CUDA (tllm.kernels.triton.moe_routing; ids int32, no host sync, CUDA-graph safe),
`route_experts_ref` in torch elsewhere (ids int64). The modes the models use:

- softmax over all experts, top-k, renormalised or not (Mixtral, Qwen MoE);
- top-k of the logits first, then softmax over the k (GPT-OSS, Granite) or the sigmoid of
  each (Llama 4): `topk_first`;
- DeepSeek's grouped routing: sigmoid (V3, Nemotron-H) or softmax (V2) scores, the correction
  bias added for the choice only, `num_groups` groups of which each token keeps its
  `topk_group` best (a group scores its best expert, or its best two summed with a bias),
  renormalised, times `routed_scaling_factor` (V2 scales only when not renormalising).

Ties: the larger choice first, the lower expert id among equal choices (likewise for
groups); the reference sorts stably to follow the same rule."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoeRouting:
    top_k: int
    num_groups: int = 1
    topk_group: int = 1
    scoring: str = "softmax"          # "softmax" or "sigmoid"
    renormalize: bool = False
    scaling_factor: float = 1.0
    scale_after_renormalize: bool = True  # DeepSeek-V3 scales renormalised weights; V2 not
    topk_first: bool = False          # top-k of the logits, then the scoring over those k

    def check(self, num_experts: int) -> None:
        """ValueError naming the config field that does not fit `num_experts`."""
        if self.scoring not in SCORINGS:
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
        if self.topk_first and self.topk_group < self.num_groups:
            raise ValueError("topk_first routing has no expert groups (n_group must be 1)")

    @property
    def is_grouped(self) -> bool:
        return self.topk_group < self.num_groups


def route_experts(router_logits: torch.Tensor, routing: MoeRouting,
                  correction_bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k]: int32 from the
    CUDA kernel, int64 from torch). `correction_bias` [E] shifts the choice, not the weights."""
    _check_route_args(router_logits, routing, correction_bias)
    if router_logits.is_cuda:
        return route_experts_kernel(router_logits, routing, correction_bias)
    return route_experts_ref(router_logits, routing, correction_bias)


def route_experts_kernel(router_logits: torch.Tensor, routing: MoeRouting,
                         correction_bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel, unchecked (on a CPU only under the Triton interpreter)."""
    from tllm.kernels.triton.moe_routing import route_experts_triton
    return route_experts_triton(
        router_logits, routing.top_k, sigmoid=routing.scoring == "sigmoid",
        topk_first=routing.topk_first, renormalize=routing.renormalize,
        scaling_factor=routing.scaling_factor,
        scale_after_renormalize=routing.scale_after_renormalize,
        num_groups=routing.num_groups, topk_group=routing.topk_group,
        correction_bias=correction_bias)


def _check_route_args(router_logits: torch.Tensor, routing: MoeRouting,
                      correction_bias: torch.Tensor | None) -> None:
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be floating point [tokens, experts], got "
                         f"{router_logits.dtype} {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    routing.check(num_experts)
    if correction_bias is None:
        return
    if routing.topk_first:
        raise ValueError("correction_bias needs scores before the top-k (topk_first is set)")
    if (correction_bias.shape != (num_experts,) or not correction_bias.is_contiguous()
            or correction_bias.device != router_logits.device):
        raise ValueError(f"correction_bias must be contiguous [{num_experts}] on "
                         f"{router_logits.device}, got {tuple(correction_bias.shape)} on "
                         f"{correction_bias.device}")


def route_experts_ref(router_logits: torch.Tensor, routing: MoeRouting,
                      correction_bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """route_experts in torch, everything in float32 (the models' reference code's order)."""
    bias = None if correction_bias is None else correction_bias.float()
    scores, choice = routing_choice(router_logits.float(), routing, bias)
    ids = top_k_ids(choice, routing.top_k)
    weights = scores.gather(1, ids)
    if routing.topk_first:
        weights = _scores(weights, routing.scoring)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.scale_after_renormalize or not routing.renormalize:
        weights = weights * routing.scaling_factor
    return weights, ids


def routing_choice(logits: torch.Tensor, routing: MoeRouting,
                   correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores the weights come from, the choice the top-k ranks: scores plus the bias,
    experts outside the best groups at -inf), in the logits' dtype."""
    if routing.topk_first:
        return logits, logits
    scores = _scores(logits, routing.scoring)
    choice = scores if correction_bias is None else scores + correction_bias
    if routing.is_grouped:
        choice = _keep_best_groups(choice, routing, by_top2=correction_bias is not None)
    return scores, choice


def top_k_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of each row's k largest values, largest first, the lower id first among equal
    values (torch.topk leaves that order open)."""
    return values.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    return logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)


def _keep_best_groups(choice: torch.Tensor, routing: MoeRouting,
                      by_top2: bool) -> torch.Tensor:
    """The choice scores with the experts outside each token's best groups at -inf."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, routing.num_groups, -1)
    scores = group_scores(choice, routing.num_groups, by_top2)
    best = top_k_ids(scores, routing.topk_group)
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, num_experts)


def group_scores(choice: torch.Tensor, num_groups: int, by_top2: bool) -> torch.Tensor:
    """[T, num_groups]: each group's best choice, or its best two summed (`by_top2`)."""
    grouped = choice.view(choice.shape[0], num_groups, -1)
    if by_top2:
        return grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    return grouped.max(dim=-1).values
