"""Fused mixture-of-experts in Triton: a grouped GEMM over all experts in one launch.

The (token, expert) pairs of a step ("pair" p = token * top_k + j) are sorted by expert and
each expert's run padded to a multiple of BLOCK_M (`align_pairs`: two small kernels, no host
sync, so a CUDA graph can hold it), which makes every BLOCK_M-row tile of the sorted list
belong to one expert; a step of one chunk of pairs (decode) sorts in one launch. Then:

  1. gate_up: ONE launch; program (m tile, n tile) reads its tile's hidden rows and that
     expert's gate and up rows, and writes silu(gate) * up (fp32, rounded once) to the
     pair's row of the intermediate [P, I];
  2. down: ONE launch of the same kernel over the intermediate, the routing weight
     multiplied in before the rounding, into [P, H];
  3. the top_k rows of each token summed in fp32 (pairs routed to experts on other ranks
     were never placed and are skipped here).

Batch-1 decode is a stream of weight bytes (each of the k experts reads its whole weight for
one row), so small M uses 16-row tiles and narrow N tiles that spread the weight over every
SM; prefill uses 64-128 row tiles, grouped so tiles of one expert share its weight in L2.
The configurations by tokens per expert are in `moe_config`.

Reference: tllm.kernels.moe.fused_experts_ref (and align_pairs_ref for the sort)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot, next_pow2
from tllm.kernels.triton.moe_decode import decode_experts, use_decode_path
from tllm.kernels.triton.moe_tiles import GemmTile, MoeConfig, config_by_load

__all__ = ["GemmTile", "MoeConfig", "PairBlocks", "align_pairs", "config_by_load",
           "expert_gemm", "fused_experts_triton", "moe_config", "sum_top_k"]

_ONE_HOT_ELEMENTS = 8192  # [pairs, experts] tile of the sort kernels (32 registers a thread)


@dataclass(frozen=True)
class PairBlocks:
    """The pairs sorted by local expert, each expert's run padded to block_m.
    sorted_pairs [max_blocks * block_m] int32 (num_pairs marks padding), block_expert
    [max_blocks] int32 (-1 past the last used tile), num_padded [1] int32 (rows in use)."""
    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


# ---- sort: pairs by expert, padded per expert ----

@triton.jit
def _local_one_hot(topk_ids_ptr, first, num_pairs, expert_start, experts,
                   NUM_EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs first .. first + CHUNK - 1 and their [CHUNK, E_PAD] one-hot local expert
    (all zero for pairs of experts on other ranks and for lanes past num_pairs)."""
    pairs = first + tl.arange(0, CHUNK)
    ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    local = tl.where(pairs < num_pairs, ids - expert_start, -1)
    hit = (local[:, None] == experts[None, :]) & (experts < NUM_EXPERTS)[None, :]
    return pairs, hit.to(tl.int32)


@triton.jit
def _count_pairs_kernel(chunk_counts_ptr, topk_ids_ptr, num_pairs, expert_start,
                        NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Program c: how many pairs of chunk c each local expert has -> chunk_counts[c, :]."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    _, hit = _local_one_hot(topk_ids_ptr, chunk * CHUNK, num_pairs, expert_start, experts,
                            NUM_EXPERTS, CHUNK)
    tl.store(chunk_counts_ptr + chunk * E_PAD + experts, tl.sum(hit, 0))


@triton.jit
def _place_pairs_kernel(sorted_ptr, block_expert_ptr, num_padded_ptr, chunk_counts_ptr,
                        topk_ids_ptr, num_pairs, num_chunks, expert_start, max_blocks,
                        NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK_M: tl.constexpr, TILES: tl.constexpr, COUNTED: tl.constexpr):
    """Program c writes chunk c's pairs to their sorted slots: the expert's padded start,
    plus the pairs of that expert in earlier chunks, plus those earlier in this chunk (a
    stable order). Program 0 also writes the tile -> expert table and the padding marks.
    Not COUNTED (one chunk, no count kernel ran): the chunk counts its own pairs."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    pairs, hit = _local_one_hot(topk_ids_ptr, chunk * CHUNK, num_pairs, expert_start, experts,
                                NUM_EXPERTS, CHUNK)
    totals = tl.sum(hit, 0)
    earlier = tl.zeros([E_PAD], dtype=tl.int32)
    if COUNTED:
        totals = tl.zeros([E_PAD], dtype=tl.int32)
        for i in range(0, num_chunks):
            row = tl.load(chunk_counts_ptr + i * E_PAD + experts)
            totals += row
            earlier += tl.where(i < chunk, row, 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    rank = tl.cumsum(hit, 0) - hit
    slot = tl.sum(hit * (rank + (starts + earlier)[None, :]), 1)
    tl.store(sorted_ptr + slot, pairs, mask=tl.sum(hit, 1) > 0)
    if chunk == 0:
        total = tl.sum(padded, 0)
        tl.store(num_padded_ptr, total)
        pad_from = starts + totals  # an expert's first padding slot
        rows = tl.arange(0, BLOCK_M)
        for t0 in range(0, max_blocks, TILES):
            tiles = t0 + tl.arange(0, TILES)
            first = tiles * BLOCK_M
            expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
            in_use = first < total
            tl.store(block_expert_ptr + tiles, tl.where(in_use, expert, -1),
                     mask=tiles < max_blocks)
            tile_pad_from = tl.sum(tl.where(experts[None, :] == expert[:, None],
                                            pad_from[None, :], 0), 1)
            slots = first[:, None] + rows[None, :]
            tl.store(sorted_ptr + slots, tl.zeros([TILES, BLOCK_M], dtype=tl.int32) + num_pairs,
                     mask=in_use[:, None] & (slots >= tile_pad_from[:, None]))


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the tiles in use, known on the host: every expert with pairs pads
    its run by fewer than block_m rows, and at most min(E, pairs) experts have pairs."""
    return cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                expert_start: int = 0, chunk: int | None = None) -> PairBlocks:
    """Sort the pairs of topk_ids [T, k] by local expert (topk_ids - expert_start in
    0 .. num_experts - 1; the rest are left out) and pad each expert's run to block_m.
    `chunk` (pairs per program, a power of two) is for tests; by default the one-hot tile
    holds _ONE_HOT_ELEMENTS."""
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    num_pairs = ids.numel()
    e_pad = max(16, next_pow2(num_experts))
    # a decode step's few pairs get a chunk (and tile loop) their size: the sort is one
    # program's latency, which a [64, E] one-hot for 8 pairs only lengthens
    chunk = chunk or max(16, min(1024, _ONE_HOT_ELEMENTS // e_pad, next_pow2(num_pairs)))
    num_chunks = max(1, cdiv(num_pairs, chunk))
    blocks = max_tiles(num_pairs, num_experts, block_m)
    device = ids.device
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    counted = num_chunks > 1  # one chunk (a decode step) counts in the place kernel
    counts = num_padded
    if counted:
        counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
        _count_pairs_kernel[(num_chunks,)](counts, ids, num_pairs, expert_start,
                                           NUM_EXPERTS=num_experts, E_PAD=e_pad, CHUNK=chunk,
                                           num_warps=4)
    tiles = max(1, min(256, _ONE_HOT_ELEMENTS // max(e_pad, block_m), next_pow2(blocks)))
    _place_pairs_kernel[(num_chunks,)](sorted_pairs, block_expert, num_padded, counts, ids,
                                       num_pairs, num_chunks, expert_start, blocks,
                                       NUM_EXPERTS=num_experts, E_PAD=e_pad, CHUNK=chunk,
                                       BLOCK_M=block_m, TILES=tiles, COUNTED=counted,
                                       num_warps=4)
    return PairBlocks(sorted_pairs, block_expert, num_padded, block_m, num_pairs)


# ---- the grouped GEMM ----

@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])  # one compile for every batch
def _expert_gemm_kernel(out_ptr, a_ptr, w_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                        topk_weights_ptr, N, K, num_pairs, num_tiles_m,
                        stride_am, stride_we, stride_wn, stride_om,
                        ROWS_PER_A: tl.constexpr, GATED: tl.constexpr,
                        RELU2: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
                        PRECISION: tl.constexpr):
    """out[pair, n] = a[pair // ROWS_PER_A] . w[expert(pair), n] for the pairs of one
    sorted tile. GATED: w holds 2N rows (gate, then up) and out = silu(gate) * up; RELU2:
    out = relu(out)^2 (Nemotron-H's non-gated experts). MUL_WEIGHT: times topk_weights[pair].
    Accumulates in fp32 and rounds once."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last tile in use: the host only knows a bound
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + (pairs // ROWS_PER_A).to(tl.int64)[:, None] * stride_am
    # a [BLOCK_K, BLOCK_N] view of this expert's W^T (rows past N are computed, not stored)
    w_base = w_ptr + expert * stride_we + (offs_n % N).to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kk
        k_ok = offs_k < K
        if EVEN_K:
            a = tl.load(a_base + offs_k[None, :], mask=is_pair[:, None], other=0.0)
            w = tl.load(w_base + offs_k[:, None])
        else:
            a = tl.load(a_base + offs_k[None, :], mask=is_pair[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_base + offs_k[:, None], mask=k_ok[:, None], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            if EVEN_K:
                w_up = tl.load(w_base + N * stride_wn + offs_k[:, None])
            else:
                w_up = tl.load(w_base + N * stride_wn + offs_k[:, None], mask=k_ok[:, None],
                               other=0.0)
            if DOT_FP32:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if RELU2:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=is_pair, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty),
             mask=is_pair[:, None] & (offs_n < N)[None, :])


def expert_gemm(a: torch.Tensor, w: torch.Tensor, blocks: PairBlocks, tile: GemmTile,
                group_m: int = 1, rows_per_a: int = 1, gated: bool = False,
                topk_weights: torch.Tensor | None = None, relu2: bool = False) -> torch.Tensor:
    """One grouped GEMM over the sorted pairs: a [P / rows_per_a, K] (the hidden rows,
    rows_per_a = top_k, or the intermediate, rows_per_a = 1), w [E, N (2N if gated), K]
    -> [P, N] in a's dtype; rows of pairs not placed (other ranks' experts) are not written."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    out = torch.empty(blocks.num_pairs, n, dtype=a.dtype, device=a.device)
    if blocks.num_pairs == 0 or n == 0:
        return out
    weights = topk_weights.reshape(-1) if topk_weights is not None else blocks.num_padded
    grid = (blocks.max_blocks * cdiv(n, tile.block_n),)
    _expert_gemm_kernel[grid](
        out, a, w, blocks.sorted_pairs, blocks.block_expert, blocks.num_padded, weights,
        n, k, blocks.num_pairs, blocks.max_blocks, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), ROWS_PER_A=rows_per_a, GATED=gated, RELU2=relu2,
        MUL_WEIGHT=topk_weights is not None, BLOCK_M=blocks.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, GROUP_M=group_m, EVEN_K=k % tile.block_k == 0,
        DOT_FP32=needs_fp32_dot(_expert_gemm_kernel, a.dtype),
        PRECISION=dot_precision(a.dtype), num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    return out


# ---- combine ----

@triton.jit
def _sum_top_k_kernel(out_ptr, pair_out_ptr, topk_ids_ptr, expert_start, H,
                      stride_o, stride_p, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                      BLOCK: tl.constexpr):
    """out[t] = the sum of pair_out rows t * TOP_K + j over the j whose expert is local."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        local = tl.load(topk_ids_ptr + pair).to(tl.int32) - expert_start
        width = tl.where((local >= 0) & (local < NUM_EXPERTS), H, 0)  # 0: not placed
        acc += tl.load(pair_out_ptr + pair * stride_p + cols, mask=cols < width,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_top_k(pair_out: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
              expert_start: int = 0) -> torch.Tensor:
    """pair_out [T * k, H] -> [T, H]: each token's local pairs summed in fp32."""
    num_tokens, top_k = topk_ids.shape
    hidden = pair_out.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=pair_out.dtype, device=pair_out.device)
    if num_tokens == 0 or hidden == 0:
        return out
    block = min(1024, next_pow2(hidden))
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    _sum_top_k_kernel[(num_tokens, cdiv(hidden, block))](
        out, pair_out, ids, expert_start, hidden, out.stride(0), pair_out.stride(0),
        NUM_EXPERTS=num_experts, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out


# ---- configurations and the whole layer ----

# (largest average pairs per expert, config), from the per-GEMM tile sweep of
# benchmarks/gpu_moe_kernel.py on an H200 (2026-12-01; Mixtral-8x7B and Qwen3-30B-A3B expert
# shapes, bf16). Decode: 16-row tiles, narrow N so the weight stream spreads over every SM
# (3.8-4.3 TB/s of weights read); prefill: 64-128 row tiles grouped for weight reuse in L2.
_CONFIGS = (
    (1, MoeConfig(16, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 4))),
    (8, MoeConfig(16, GemmTile(32, 128, 4, 4), GemmTile(128, 128, 4, 3))),
    (32, MoeConfig(32, GemmTile(64, 128, 4, 3), GemmTile(128, 128, 4, 3), group_m=8)),
    (96, MoeConfig(64, GemmTile(64, 64, 4, 4), GemmTile(128, 64, 4, 4), group_m=8)),
    (float("inf"), MoeConfig(128, GemmTile(128, 64, 8, 3), GemmTile(256, 64, 8, 3),
                             group_m=16)),
)


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoeConfig:
    """The tile configuration for a step, by the average pairs an expert gets."""
    return config_by_load(_CONFIGS, num_tokens, top_k, num_experts)


def fused_experts_triton(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         expert_start: int = 0, config: MoeConfig | None = None,
                         activation: str = "silu_gated",
                         decode: bool | None = None) -> torch.Tensor:
    """tllm.kernels.moe.fused_experts on the Triton kernels (arguments checked there);
    `activation` "relu2": w13 is the up projection alone [E, I, H] and the intermediate is
    relu(x W^T)^2 (tllm.kernels.moe.relu2_experts). `decode`: the sort-free path of
    tllm.kernels.triton.moe_decode (None: where `use_decode_path` says, unless a tile
    config is given)."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    if decode is None:
        decode = config is None and use_decode_path(num_tokens, top_k, num_experts)
    if decode:
        return decode_experts(hidden, w13, w2, topk_weights, topk_ids, expert_start,
                              activation)
    cfg = config or moe_config(num_tokens, top_k, num_experts)
    blocks = align_pairs(topk_ids, num_experts, cfg.block_m, expert_start)
    relu2 = activation == "relu2"
    inter = expert_gemm(hidden, w13, blocks, cfg.gate_up, cfg.group_m, rows_per_a=top_k,
                        gated=not relu2, relu2=relu2)
    pair_out = expert_gemm(inter, w2, blocks, cfg.down, cfg.group_m,
                           topk_weights=topk_weights.float().contiguous())
    return sum_top_k(pair_out, topk_ids, num_experts, expert_start)
