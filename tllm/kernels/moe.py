"""Mixture-of-experts feed-forward over routed tokens: each token goes through its top-k
experts (gate_up, activation, down) and the outputs are summed with the routing weights.

`fused_experts` is what the MoE layer calls: the grouped Triton kernels on CUDA, the torch
version below on a CPU. `fused_experts_ref` sorts the (token, expert) pairs by expert and
runs one pair of matmuls per expert that has tokens: the reference for the kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_start: int = 0) -> torch.Tensor:
    """hidden [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows); w2
    [E, H, I]; topk_weights [T, k] float32; topk_ids [T, k] global expert ids. This rank
    holds experts expert_start .. expert_start + E - 1 (expert parallelism); the pairs
    routed elsewhere add nothing here. Returns [T, H] in hidden's dtype."""
    return fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids, expert_start)


def fused_experts_ref(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_start: int = 0) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    local = topk_ids.flatten().long() - expert_start
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local.clamp(-1, num_experts).add(1),
                            minlength=num_experts + 2)[1:num_experts + 1].tolist()
    start = int((local < 0).sum())  # pairs of experts below this rank's sort first
    weights = topk_weights.flatten().float()
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        rows = pairs // top_k
        gate_up = hidden[rows] @ w13[expert].t()
        gate, up = gate_up.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[expert].t()
        out.index_add_(0, rows, y.float() * weights[pairs, None])
    return out.to(hidden.dtype)
