"""Experts with biases and GPT-OSS's clamped SwiGLU, in torch: the CPU path and the reference
for the Triton kernels (tllm.kernels.triton.swiglu_moe). Each routed (token, expert) pair computes

    gate, up = x W13^T + b13 (gate rows first); gate <= limit, -limit <= up <= limit;
    y = ((up + 1) * gate * sigmoid(alpha * gate)) W2^T + b2

and a token's output is the routing-weighted sum of its pairs' y."""
from __future__ import annotations

from typing import Callable

import torch

# expert id (local) -> (w13 [2I, H], b13 [2I], w2 [H, I], b2 [H] or None), in hidden's dtype
ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor | None]]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """GPT-OSS's activation, in HF's order of operations."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def swiglu_experts_ref(hidden: torch.Tensor, expert_weights: ExpertWeights,
                       num_local_experts: int, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, alpha: float, limit: float,
                       expert_start: int = 0) -> torch.Tensor:
    """hidden [T, H]; topk_* [T, k] (global expert ids; pairs of experts outside this
    rank's expert_start .. + num_local_experts add nothing). Experts are fetched one at a
    time by `expert_weights`, so packed weights need only one expert dequantized at once.
    Returns [T, H] in hidden's dtype, summed in float32."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    local = topk_ids.flatten().long() - expert_start
    weights = topk_weights.flatten().float()
    for expert in torch.unique(local).tolist():
        if not 0 <= expert < num_local_experts:
            continue
        pairs = torch.nonzero(local == expert).flatten()
        rows = pairs // top_k
        w13, b13, w2, b2 = expert_weights(expert)
        gate, up = (hidden[rows] @ w13.t() + b13).chunk(2, dim=-1)
        y = clamped_swiglu(gate, up, alpha, limit) @ w2.t()
        if b2 is not None:
            y = y + b2
        out.index_add_(0, rows, y.float() * weights[pairs, None])
    return out.to(hidden.dtype)
