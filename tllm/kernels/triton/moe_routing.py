"""A mixture-of-experts router in one Triton launch: router logits [T, E] in, each token's
top-k weights [T, k] float32 and expert ids [T, k] int32 out (int32: what align_pairs and the
expert GEMMs read). A program takes BLOCK_T tokens, all E experts of each in registers:

  1. scores: softmax or sigmoid of the logits (float32), plus the correction bias for the
     choice (not for the weights); or, top-k first (GPT-OSS, Llama 4), the logits themselves;
  2. groups (DeepSeek): a group scores its best expert, or the sum of its best two with a
     bias; each token keeps its topk_group best groups, the rest of the choice goes to -inf;
  3. top-k: k rounds of "take the best remaining expert" (ties: the lower expert id);
  4. weights: the chosen scores (top-k first: softmax or sigmoid over the k logits),
     renormalised to sum 1 when asked, times the routed scaling factor.

No host sync and launch shapes fixed by T, so a CUDA graph holds it.
Reference: tllm.kernels.moe_routing.route_experts_ref (the same tie rule)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import cdiv, next_pow2

_ELEMENTS_PER_PROGRAM = 1024  # BLOCK_T * E_PAD: tokens per program for small E


@triton.jit
def _take_best(values, taken, lanes, PAD: tl.constexpr):
    """Per row, the lane of the largest value not yet taken (the lowest lane among equals;
    -inf values are taken in lane order once nothing larger is left)."""
    candidates = tl.where(taken, float("-inf"), values)
    best = tl.max(candidates, 1)
    is_best = (candidates == best[:, None]) & ~taken
    return tl.min(tl.where(is_best, lanes[None, :], PAD), 1)


@triton.jit
def _keep_best_groups(choice, experts, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr,
                      GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
                      G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                      GROUP_TOP2: tl.constexpr):
    """The choice with the experts outside each token's TOPK_GROUP best groups at -inf."""
    group_of = experts // GROUP_SIZE  # padding lanes fall past the last group
    groups = tl.arange(0, G_PAD)
    group_scores = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
    for g in tl.static_range(NUM_GROUPS):
        in_group = (group_of == g)[None, :]
        members = tl.where(in_group, choice, float("-inf"))
        score = tl.max(members, 1)
        if GROUP_TOP2:
            first = _take_best(members, ~in_group, experts, E_PAD)
            second = tl.where(experts[None, :] == first[:, None], float("-inf"), members)
            score += tl.max(second, 1)
        group_scores = tl.where(groups[None, :] == g, score[:, None], group_scores)
    group_taken = tl.broadcast_to((groups >= NUM_GROUPS)[None, :], (BLOCK_T, G_PAD))
    keep = tl.broadcast_to((experts < 0)[None, :], (BLOCK_T, E_PAD))
    for _ in tl.static_range(TOPK_GROUP):
        g = _take_best(group_scores, group_taken, groups, G_PAD)
        group_taken = group_taken | (groups[None, :] == g[:, None])
        keep = keep | (group_of[None, :] == g[:, None])
    return tl.where(keep, choice, float("-inf"))


@triton.jit
def _score(x, lanes_ok, SIGMOID: tl.constexpr):
    """Sigmoid of each value, or softmax along dim 1 over the lanes that are ok."""
    if SIGMOID:
        out = tl.sigmoid(x)
    else:
        shifted = tl.where(lanes_ok, tl.exp(x - tl.max(tl.where(lanes_ok, x, float("-inf")),
                                                       1)[:, None]), 0.0)
        out = shifted / tl.sum(shifted, 1)[:, None]
    return out


@triton.jit
def _top_k(choice, scores, is_expert, experts, slots, BLOCK_T: tl.constexpr,
           E_PAD: tl.constexpr, K_PAD: tl.constexpr, TOP_K: tl.constexpr):
    """(the scores, the expert ids) of each row's TOP_K best choices, best first."""
    taken = tl.broadcast_to(~is_expert[None, :], (BLOCK_T, E_PAD))
    top_values = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    top_ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        best = _take_best(choice, taken, experts, E_PAD)
        is_best = experts[None, :] == best[:, None]
        taken = taken | is_best
        value = tl.sum(tl.where(is_best, scores, 0.0), 1)
        top_values = tl.where(slots[None, :] == j, value[:, None], top_values)
        top_ids = tl.where(slots[None, :] == j, best[:, None], top_ids)
    return top_values, top_ids


@triton.jit
def _route_kernel(weights_ptr, ids_ptr, logits_ptr, bias_ptr, num_tokens, stride_t,
                  scaling_factor, NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr,
                  BLOCK_T: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  SIGMOID: tl.constexpr, TOPK_FIRST: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RENORMALIZE: tl.constexpr, SCALE: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  NUM_GROUPS: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  GROUP_TOP2: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, E_PAD)
    row_ok = rows < num_tokens
    is_expert = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + experts[None, :],
                     mask=row_ok[:, None] & is_expert[None, :],
                     other=float("-inf")).to(tl.float32)
    logits = tl.where(row_ok[:, None], logits, 0.0)  # rows past T: finite, never stored
    if TOPK_FIRST:
        scores = logits
        choice = logits
    else:
        scores = _score(logits, is_expert[None, :], SIGMOID)
        choice = scores
        if HAS_BIAS:
            choice += tl.load(bias_ptr + experts, mask=is_expert, other=0.0).to(tl.float32)
        if TOPK_GROUP < NUM_GROUPS:
            choice = _keep_best_groups(choice, experts, BLOCK_T, E_PAD, GROUP_SIZE,
                                       NUM_GROUPS, G_PAD, TOPK_GROUP, GROUP_TOP2)
    slots = tl.arange(0, K_PAD)
    is_slot = (slots < TOP_K)[None, :]
    weights, top_ids = _top_k(choice, scores, is_expert, experts, slots, BLOCK_T, E_PAD,
                              K_PAD, TOP_K)
    if TOPK_FIRST:
        weights = _score(weights, is_slot, SIGMOID)
    if RENORMALIZE:
        weights = weights / (tl.sum(tl.where(is_slot, weights, 0.0), 1)[:, None] + 1e-20)
    if SCALE:
        weights = weights * scaling_factor
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = row_ok[:, None] & is_slot
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, top_ids, mask=mask)


def route_experts_triton(router_logits: torch.Tensor, top_k: int, *, sigmoid: bool,
                         topk_first: bool, renormalize: bool, scaling_factor: float,
                         scale_after_renormalize: bool, num_groups: int, topk_group: int,
                         correction_bias: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over router_logits [T, E] (arguments checked by the caller,
    tllm.kernels.moe_routing.route_experts) -> (weights [T, k] float32, ids [T, k] int32)."""
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = next_pow2(num_experts)
    block_t = max(1, min(next_pow2(num_tokens), _ELEMENTS_PER_PROGRAM // e_pad))
    group_size = num_experts // num_groups
    bias = correction_bias if correction_bias is not None else logits
    _route_kernel[(cdiv(num_tokens, block_t),)](
        weights, ids, logits, bias, num_tokens, logits.stride(0), float(scaling_factor),
        NUM_EXPERTS=num_experts, E_PAD=e_pad, BLOCK_T=block_t, TOP_K=top_k,
        K_PAD=next_pow2(top_k), SIGMOID=sigmoid, TOPK_FIRST=topk_first,
        HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize,
        SCALE=scaling_factor != 1.0 and (scale_after_renormalize or not renormalize),
        GROUP_SIZE=group_size, NUM_GROUPS=num_groups, G_PAD=next_pow2(num_groups),
        TOPK_GROUP=topk_group, GROUP_TOP2=correction_bias is not None and group_size >= 2,
        num_warps=max(1, min(8, block_t * e_pad // 256)))
    return weights, ids
