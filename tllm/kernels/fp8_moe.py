"""FP8 W8A8 mixture of experts: e4m3 expert weights with float32 scales, activations
quantized at run time (per token, or per token and group of bk columns with block scales).

The weights of an MoE layer in their run-time form (`Fp8Experts`):
  w13 [E, 2I, H] and w2 [E, H, I] e4m3;
  per-channel scales w13_scale [E, 2I, 1], w2_scale [E, H, 1] (per-tensor checkpoints are
  spread over their rows at load), or with block = (bn, bk) block scales w13_scale
  [E, 2I / bn, ceil(H / bk)], w2_scale [E, ceil(H / bn), I / bk].

Where the activations are quantized (the kernels do the same): the hidden rows once per
token before gate_up; silu(gate) * up of each (token, expert) pair, rounded to the hidden
dtype, per pair row before down.

`fp8_fused_experts` is what the MoE method calls: the grouped Triton kernels of
tllm.kernels.triton.fp8_fused_moe on CUDA, the exact torch emulation below elsewhere
(`fp8_fused_experts_ref`, also the kernels' reference)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tllm.kernels import fp8 as ref


@dataclass(frozen=True)
class Fp8Experts:
    """One layer's local experts in fp8 (module docstring); block None: per-channel scales."""
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def dequantized(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of a local expert in float32."""
        return (dequantize(self.w13[expert], self.w13_scale[expert], self.block),
                dequantize(self.w2[expert], self.w2_scale[expert], self.block))


def dequantize(q: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> torch.Tensor:
    """One expert's fp8 weight [N, K] with its scales -> float32 [N, K]."""
    if block is not None:
        return ref.dequantize_blocks(q, scale, block)
    return q.float() * scale.float().reshape(-1, 1)


def check_fp8_experts(hidden: torch.Tensor, experts: Fp8Experts) -> None:
    """ValueError naming the part of `experts` that does not fit hidden [T, H]."""
    if experts.w13.dtype != ref.FP8_DTYPE or experts.w2.dtype != ref.FP8_DTYPE:
        raise ValueError(f"experts: w13 and w2 must be {ref.FP8_DTYPE}, got "
                         f"{experts.w13.dtype} and {experts.w2.dtype}")
    num, rows, size = experts.w13.shape
    inter = rows // 2
    if hidden.dim() != 2 or size != hidden.shape[1] or rows % 2:
        raise ValueError(f"experts: w13 {tuple(experts.w13.shape)} does not fit hidden "
                         f"{tuple(hidden.shape)}")
    if tuple(experts.w2.shape) != (num, size, inter):
        raise ValueError(f"experts: w2 must be {[num, size, inter]}, got "
                         f"{tuple(experts.w2.shape)}")
    if experts.block is None:
        want13, want2 = (num, rows, 1), (num, size, 1)
    else:
        bn, bk = experts.block
        if inter % bn or inter % bk:
            raise ValueError(f"experts: block {experts.block} must divide the intermediate "
                             f"size {inter}")
        want13 = (num, rows // bn, -(-size // bk))
        want2 = (num, -(-size // bn), inter // bk)
    for name, scale, want in (("w13_scale", experts.w13_scale, want13),
                              ("w2_scale", experts.w2_scale, want2)):
        if tuple(scale.shape) != want or scale.dtype != torch.float32:
            raise ValueError(f"experts: {name} must be float32 {list(want)}, got "
                             f"{scale.dtype} {tuple(scale.shape)}")


def fp8_fused_experts(hidden: torch.Tensor, experts: Fp8Experts, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_start: int = 0) -> torch.Tensor:
    """hidden [T, H] (bf16/fp16/fp32) through each token's top-k fp8 experts, weighted by
    topk_weights [T, k] and summed -> [T, H] in hidden's dtype. This rank holds experts
    expert_start .. expert_start + E - 1; pairs routed elsewhere add nothing here."""
    check_fp8_experts(hidden, experts)
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and _triton_ok(
            experts.block):
        from tllm.kernels.triton.fp8_fused_moe import fp8_fused_experts_triton
        return fp8_fused_experts_triton(hidden, experts.w13, experts.w13_scale, experts.w2,
                                        experts.w2_scale, experts.block, topk_weights,
                                        topk_ids, expert_start)
    return fp8_fused_experts_ref(hidden, experts, topk_weights, topk_ids, expert_start)


def _triton_ok(block: tuple[int, int] | None) -> bool:
    """The kernel's K tiles must lie inside one scale block: bk a power of two, and at least
    32 (an fp8 tl.dot needs K >= 32 on Hopper: 16-column blocks failed to compile on an
    H100; checkpoints use 128)."""
    return block is None or (block[1] >= 32 and block[1] & (block[1] - 1) == 0)


def quantize_rows(x: torch.Tensor, block: tuple[int, int] | None):
    """Dynamic activation quantization: per row, or per row and group of bk columns."""
    if block is None:
        return ref.quantize_per_token(x)
    return ref.quantize_per_token_group(x, block[1])


def _w8a8_mm(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             block: tuple[int, int] | None) -> torch.Tensor:
    """x [M, K] quantized per row (group), times the fp8 weight [N, K] -> float32 [M, N]."""
    xq, x_scale = quantize_rows(x, block)
    if block is None:
        return ref.scaled_mm_ref(xq, x_scale, wq, w_scale, torch.float32)
    return ref.block_scaled_mm_ref(xq, x_scale, wq, w_scale, block, torch.float32)


def fp8_fused_experts_ref(hidden: torch.Tensor, experts: Fp8Experts,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          expert_start: int = 0) -> torch.Tensor:
    """The exact emulation: per expert that has pairs, W8A8 gate_up (fp32), silu(gate) * up
    rounded to hidden's dtype, W8A8 down, weighted and summed in fp32. A row's quantization
    does not depend on the other rows, so quantizing an expert's rows is the kernels' one
    pass over all of them."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return _captured_experts_ref(hidden, experts, topk_weights, topk_ids - expert_start, out)
    local = topk_ids.flatten().long() - expert_start
    weights = topk_weights.flatten().float()
    for expert in range(experts.num_experts):
        pairs = torch.nonzero(local == expert).flatten()
        if pairs.numel() == 0:
            continue
        rows = pairs // top_k
        y = _expert_ref(hidden[rows], experts, expert)
        out.index_add_(0, rows, y * weights[pairs, None])
    return out.to(hidden.dtype)


def _expert_ref(rows: torch.Tensor, experts: Fp8Experts, expert: int) -> torch.Tensor:
    """One expert on its rows: W8A8 gate_up, silu(gate) * up rounded to the rows' dtype,
    W8A8 down -> float32."""
    gate_up = _w8a8_mm(rows, experts.w13[expert], experts.w13_scale[expert], experts.block)
    gate, up = gate_up.chunk(2, dim=-1)
    inter = (F.silu(gate) * up).to(rows.dtype)
    return _w8a8_mm(inter, experts.w2[expert], experts.w2_scale[expert], experts.block)


def _captured_experts_ref(hidden: torch.Tensor, experts: Fp8Experts, topk_weights: torch.Tensor,
                          local_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The emulation inside a CUDA graph: no host sync (no nonzero over the routing), so
    every expert runs on every row and rows not routed to it weigh 0. Each row quantizes
    alone, so a row's result is the loop's; E / top_k times the work, for the emulation
    (float32 on a GPU, the tests) only."""
    for expert in range(experts.num_experts):
        weight = (topk_weights.float() * (local_ids == expert)).sum(dim=1, keepdim=True)
        out += _expert_ref(hidden, experts, expert) * weight
    return out.to(hidden.dtype)
