"""Mixture-of-experts feed-forward over routed tokens: each token goes through its top-k
experts (gate_up, activation, down) and the outputs are summed with the routing weights.

`fused_experts` is what the MoE layer calls: the grouped Triton kernels of
`tllm.kernels.triton.fused_moe` on CUDA, the torch version below on a CPU.
`fused_experts_ref` sorts the (token, expert) pairs by expert and runs one pair of matmuls
per expert that has tokens: the reference for the kernels, as `align_pairs_ref` is for
their sort."""
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
    check_experts_args(hidden, w13, w2, topk_weights, topk_ids, expert_start)
    if hidden.is_cuda:
        from tllm.kernels.triton.fused_moe import fused_experts_triton
        return fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids, expert_start)
    return fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids, expert_start)


def relu2_experts(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Non-gated squared-ReLU experts (Nemotron-H's): each routed pair computes
    relu(x w1[e]^T)^2 w2[e]^T, a token's output the routing-weighted sum. hidden [T, H];
    w1 [E, I, H]; w2 [E, H, I]; topk_* [T, k]. On CUDA the fused MoE kernels (no host
    sync: CUDA graphs hold it), else a torch loop over the experts chosen."""
    if w1.dim() != 3 or w2.shape != (w1.shape[0], w1.shape[2], w1.shape[1]):
        raise ValueError(f"w1 [E, I, H] and w2 [E, H, I] expected, got {tuple(w1.shape)} "
                         f"and {tuple(w2.shape)}")
    if hidden.is_cuda:
        from tllm.kernels.triton.fused_moe import fused_experts_triton
        return fused_experts_triton(hidden, w1, w2, topk_weights, topk_ids,
                                    activation="relu2")
    return relu2_experts_ref(hidden, w1, w2, topk_weights, topk_ids)


def relu2_experts_ref(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """relu2_experts in torch (summed in float32, as the kernels do)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        h = torch.relu(hidden[token] @ w1[expert].t()).square()
        out.index_add_(0, token, (h @ w2[expert].t()).float()
                       * topk_weights[token, slot, None].float())
    return out.to(hidden.dtype)


def check_experts_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       expert_start: int) -> None:
    """ValueError naming the argument whose shape, dtype or layout does not fit."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden], got {tuple(hidden.shape)}")
    num_tokens, size = hidden.shape
    if w13.dim() != 3 or w13.shape[2] != size or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [experts, 2 * intermediate, {size}], got "
                         f"{tuple(w13.shape)}")
    expected_w2 = (w13.shape[0], size, w13.shape[1] // 2)
    if tuple(w2.shape) != expected_w2:
        raise ValueError(f"w2 must be {list(expected_w2)}, got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [{num_tokens}, top_k], got "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point of topk_ids' shape "
                         f"{tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != hidden.dtype or w.device != hidden.device:
            raise ValueError(f"{name} is {w.dtype} on {w.device}; hidden is {hidden.dtype} "
                             f"on {hidden.device}")
        if w.stride(-1) != 1:
            raise ValueError(f"{name} needs contiguous rows")
    if hidden.stride(-1) != 1:
        raise ValueError("hidden needs contiguous rows")
    if expert_start < 0:
        raise ValueError(f"expert_start must be >= 0, got {expert_start}")


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


def align_pairs_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    expert_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (token * k + j) of local experts in a stable sort by expert, each expert's
    run padded with num_pairs to a multiple of block_m, and the expert of each block_m
    tile: (sorted_pairs [num_padded], block_expert [num_padded / block_m])."""
    local = topk_ids.flatten().long() - expert_start
    num_pairs = local.numel()
    sorted_pairs, block_expert = [], []
    for expert in range(num_experts):
        pairs = torch.nonzero(local == expert).flatten()
        if pairs.numel() == 0:
            continue
        tiles = -(-pairs.numel() // block_m)
        padding = pairs.new_full((tiles * block_m - pairs.numel(),), num_pairs)
        sorted_pairs.append(torch.cat([pairs, padding]))
        block_expert += [expert] * tiles
    if not sorted_pairs:
        return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    return (torch.cat(sorted_pairs).int().cpu(),
            torch.tensor(block_expert, dtype=torch.int32))
