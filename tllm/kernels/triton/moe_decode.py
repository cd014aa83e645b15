"""Mixture-of-experts for a decode step's few tokens, without the sort: two launches where
the tile path (tllm.kernels.triton.fused_moe) takes four or five.

  1. gate_up: program (pair, n tile) reads its pair's expert from topk_ids and streams that
     expert's gate and up rows (or, relu2, its up rows) against the token's hidden row in
     [BLOCK_N, BLOCK_K] tiles with a full-width fp32 accumulator summed once at the end (the
     dense GEMV's loop, tllm.kernels.triton.dense_gemv), and writes silu(gate) * up (fp32,
     rounded once) to the pair's row of the intermediate [P, I];
  2. down and combine: program (token, n tile) walks the token's top_k pairs: each local
     pair's down rows against its intermediate row, times its routing weight, rounded to the
     dtype (as the tile path rounds a pair's row), summed in fp32 in pair order, rounded
     once. Pairs of experts on other ranks are skipped (their intermediate row is never
     written).

FP8 experts (e4m3 weights, tllm.kernels.fp8_moe.Fp8Experts) take the same kernels as W8A16:
the weights widened in registers against unquantized activations (as the FP8 tile path does
at decode), per-channel scales applied once at the end, block scales to each K tile
(BLOCK_K divides bk).

Why: at batch 1 a layer's experts are a weight stream that the tile path pads to 16-row
tiles after a sort (one program's latency) and sums in a third kernel: on an H100, Qwen3-30B-
A3B's sort and sum took 8.5 us a layer beside 32 us of expert GEMMs (benchmarks/results/
gpu_profile_decode_2026-12-06_h100.json). Each pair here reads its expert's weight itself,
so the path is for steps whose pairs rarely share an expert (`use_decode_path`); the tile
path reads a shared expert once per tile.

References: tllm.kernels.moe.fused_experts_ref / relu2_experts_ref, and for FP8 the first on
the dequantized weights."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.dense_gemv import _load_tile
from tllm.kernels.triton.launch import cdiv, next_pow2
from tllm.kernels.triton.moe_tiles import GemmTile

# A pair's expert is rarely another's when the step's pairs are at most this share of the
# experts (expected distinct experts of P uniform draws from E: E (1 - (1 - 1/E)^P), 89% of
# P at P = E / 4); one token's top-k experts are always distinct.
_PAIRS_PER_EXPERT = 0.25
# TLLM_MOE_DECODE_PATH=0 sends every step to the tile path (a diagnostic switch: A/B timing,
# or a device where the decode kernels misbehave)
_DECODE_PATH_ON = os.environ.get("TLLM_MOE_DECODE_PATH", "1") != "0"


@dataclass(frozen=True)
class MoeDecodeConfig:
    """gate_up: block_n output columns of each of gate and up a program (relu2: of up);
    down: block_n output columns a program, over every pair of its token."""
    gate_up: GemmTile = GemmTile(2, 1024, 4, 2)
    down: GemmTile = GemmTile(4, 1024, 4, 2)


# Not timed yet (benchmarks/gpu_moe_decode.py sweeps them on a GPU): the dense GEMV's
# defaults for its silu_mul and plain kinds (2 and 4 rows x 1024 columns on 4 warps: 16
# bytes a thread a row of a bf16 tile); fp8 weights take twice the columns for the same
# bytes in flight.
DEFAULT_DECODE_CONFIG = MoeDecodeConfig()
FP8_DECODE_CONFIG = MoeDecodeConfig(GemmTile(2, 2048, 4, 2), GemmTile(4, 2048, 4, 2))


def use_decode_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a step of num_tokens takes the sort-free decode path: one token, or pairs at
    most a quarter of the experts (few pairs share an expert's weight read)."""
    return _DECODE_PATH_ON and (
        num_tokens == 1 or 0 < num_tokens * top_k <= _PAIRS_PER_EXPERT * num_experts)


# weight scales: none (bf16 / fp16 / fp32 experts), one per output row, or one per block
NO_SCALES, ROW_SCALES, BLOCK_SCALES = 0, 1, 2


@triton.jit
def _rows_dot(x_ptrs, w_ptrs, ws_ptrs, stride_wsk, offs_k, K, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SCALES: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """x_ptrs [1, BLOCK_K] . w_ptrs [BLOCK_N, BLOCK_K] over K -> [1, BLOCK_N] fp32; ws_ptrs
    [BLOCK_N]: each row's scale (ROW_SCALES) or its row block's scale at K block 0
    (BLOCK_SCALES, the next K block stride_wsk further)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = (k0 + offs_k)[None, :]
        x = _load_tile(x_ptrs + k0, cols, K, EVEN_K, "evict_last")
        w = _load_tile(w_ptrs + k0, cols, K, EVEN_K, "evict_first")
        if SCALES == 2:
            w = w * tl.load(ws_ptrs + (k0 // SCALE_BLOCK_K) * stride_wsk)[:, None]
        acc += w * x
    out = tl.sum(acc, axis=1)
    if SCALES == 1:
        out = out * tl.load(ws_ptrs)
    return out[None, :]


@triton.jit
def _scale_rows(ws_ptr, rows, stride_wsn, SCALES: tl.constexpr, SCALE_BLOCK_N: tl.constexpr):
    """Pointers to the scales of weight rows `rows` (K block 0 for BLOCK_SCALES)."""
    if SCALES == 2:
        return ws_ptr + (rows // SCALE_BLOCK_N) * stride_wsn
    return ws_ptr + rows * stride_wsn


@triton.jit
def _pair_gate_up_kernel(inter_ptr, hidden_ptr, w_ptr, ws_ptr, topk_ids_ptr, expert_start,
                         N, K, stride_h, stride_we, stride_wn, stride_wse, stride_wsn,
                         stride_wsk, stride_i, NUM_EXPERTS: tl.constexpr,
                         TOP_K: tl.constexpr, GATED: tl.constexpr, SCALES: tl.constexpr,
                         SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         NUM_STAGES: tl.constexpr):
    """inter[pair, n tile] = silu(h . gate) * (h . up) (GATED; w [E, 2N, K]) or
    relu(h . up)^2 (w [E, N, K]) for h = hidden[pair // TOP_K] and the pair's expert."""
    pair = tl.program_id(0).to(tl.int64)
    local = tl.load(topk_ids_ptr + pair).to(tl.int32) - expert_start
    if (local < 0) | (local >= NUM_EXPERTS):
        return  # another rank's expert: the down kernel skips this pair
    expert = local.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_n % N).to(tl.int64)  # rows past N are computed, not stored
    w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    ws_ptr += expert * stride_wse
    x_ptrs = hidden_ptr + (pair // TOP_K) * stride_h + offs_k[None, :]
    g = _rows_dot(x_ptrs, w_ptrs, _scale_rows(ws_ptr, rows, stride_wsn, SCALES, SCALE_BLOCK_N),
                  stride_wsk, offs_k, K, BLOCK_N, BLOCK_K, SCALES, SCALE_BLOCK_K, EVEN_K,
                  NUM_STAGES)
    if GATED:
        u = _rows_dot(x_ptrs, w_ptrs + N * stride_wn,
                      _scale_rows(ws_ptr, N + rows, stride_wsn, SCALES, SCALE_BLOCK_N),
                      stride_wsk, offs_k, K, BLOCK_N, BLOCK_K, SCALES, SCALE_BLOCK_K, EVEN_K,
                      NUM_STAGES)
        out = g * tl.sigmoid(g) * u
    else:
        out = tl.maximum(g, 0.0)
        out = out * out
    tl.store(inter_ptr + pair * stride_i + offs_n[None, :],
             out.to(inter_ptr.dtype.element_ty), mask=(offs_n < N)[None, :])


@triton.jit
def _token_down_kernel(out_ptr, inter_ptr, w_ptr, ws_ptr, topk_ids_ptr, topk_weights_ptr,
                       expert_start, N, K, stride_o, stride_i, stride_we, stride_wn,
                       stride_wse, stride_wsn, stride_wsk, NUM_EXPERTS: tl.constexpr,
                       TOP_K: tl.constexpr, SCALES: tl.constexpr,
                       SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    """out[token, n tile] = sum over the token's local pairs of
    round(weight * inter[pair] . w[expert, n tile]), in fp32, pair order."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_n % N).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        local = tl.load(topk_ids_ptr + pair).to(tl.int32) - expert_start
        if (local >= 0) & (local < NUM_EXPERTS):
            expert = local.to(tl.int64)
            w_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
            ws_ptrs = _scale_rows(ws_ptr + expert * stride_wse, rows, stride_wsn, SCALES,
                                  SCALE_BLOCK_N)
            y = _rows_dot(inter_ptr + pair * stride_i + offs_k[None, :], w_ptrs, ws_ptrs,
                          stride_wsk, offs_k, K, BLOCK_N, BLOCK_K, SCALES, SCALE_BLOCK_K,
                          EVEN_K, NUM_STAGES)
            weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
            acc += (y * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_o + offs_n[None, :], acc.to(dtype),
             mask=(offs_n < N)[None, :])


def _scale_args(w: torch.Tensor, w_scale: torch.Tensor | None,
                block: tuple[int, int] | None, block_k: int
                ) -> tuple[torch.Tensor, tuple[int, int, int], dict, int]:
    """(the scale tensor to pass, its strides, the SCALES* constexprs, BLOCK_K): no scales
    pass w itself (never read); block scales cap BLOCK_K at bk."""
    if w_scale is None:
        return w, (0, 0, 0), dict(SCALES=NO_SCALES, SCALE_BLOCK_N=1, SCALE_BLOCK_K=1), block_k
    strides = (w_scale.stride(0), w_scale.stride(1), w_scale.stride(2))
    if block is None:
        return w_scale, strides, dict(SCALES=ROW_SCALES, SCALE_BLOCK_N=1,
                                      SCALE_BLOCK_K=1), block_k
    return w_scale, strides, dict(SCALES=BLOCK_SCALES, SCALE_BLOCK_N=block[0],
                                  SCALE_BLOCK_K=block[1]), min(block_k, block[1])


def decode_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   expert_start: int = 0, activation: str = "silu_gated",
                   config: MoeDecodeConfig | None = None,
                   w13_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """The experts of hidden [T, H] on the sort-free path (arguments checked by
    tllm.kernels.moe / fp8_moe): w13 [E, 2I, H] (relu2: [E, I, H]), w2 [E, H, I] -> [T, H].
    FP8 weights come with their scales (Fp8Experts' layouts; `block` (bn, bk) for block
    scales, None for per-channel)."""
    cfg = config or (FP8_DECODE_CONFIG if w13.element_size() == 1 else DEFAULT_DECODE_CONFIG)
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden_size, inter_size = w2.shape
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0 or hidden_size == 0:
        return out
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    inter = torch.empty(num_tokens * top_k, inter_size, dtype=hidden.dtype,
                        device=hidden.device)
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    tile = cfg.gate_up
    scale, strides, kind, block_k = _scale_args(w13, w13_scale, block,
                                                min(tile.block_k, next_pow2(hidden_size)))
    _pair_gate_up_kernel[(num_tokens * top_k, cdiv(inter_size, tile.block_n))](
        inter, x, w13, scale, ids, expert_start, inter_size, hidden_size, x.stride(0),
        w13.stride(0), w13.stride(1), *strides, inter.stride(0), NUM_EXPERTS=num_experts,
        TOP_K=top_k, GATED=activation != "relu2", BLOCK_N=tile.block_n, BLOCK_K=block_k,
        EVEN_K=hidden_size % block_k == 0, NUM_STAGES=tile.num_stages,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **kind)
    tile = cfg.down
    scale, strides, kind, block_k = _scale_args(w2, w2_scale, block,
                                                min(tile.block_k, next_pow2(inter_size)))
    _token_down_kernel[(num_tokens, cdiv(hidden_size, tile.block_n))](
        out, inter, w2, scale, ids, topk_weights.float().contiguous(), expert_start,
        hidden_size, inter_size, out.stride(0), inter.stride(0), w2.stride(0), w2.stride(1),
        *strides, NUM_EXPERTS=num_experts, TOP_K=top_k, BLOCK_N=tile.block_n,
        BLOCK_K=block_k, EVEN_K=inter_size % block_k == 0, NUM_STAGES=tile.num_stages,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **kind)
    return out
