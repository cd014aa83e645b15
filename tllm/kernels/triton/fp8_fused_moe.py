"""FP8 experts in Triton: the grouped GEMMs of tllm.kernels.triton.fused_moe (its pair sort
`align_pairs` and top-k sum) with e4m3 expert weights, on tile configurations of their own
(tllm.kernels.triton.fp8_moe_configs).

Two forms of one kernel, by the tile size the step's tokens per expert choose:
  W8A8 (prefill and large batches, 32-row tiles and up): the hidden rows are quantized once
    per token (per token and bk columns with block scales) by tllm.kernels.triton.fp8_quant,
    gate_up runs fp8 x fp8 tl.dot with fp32 accumulation, its silu(gate) * up is written in
    the hidden dtype, quantized per pair row again, and down runs the same way. Per-channel
    scales multiply the accumulator once at the end (x scale per row, w scale per column);
    block scales multiply each K tile's partial product (BLOCK_K divides bk).
  W8A16 (decode, 16-row tiles): at a few pairs per expert the step is a stream of weight
    bytes; the fp8 weights are widened to the activation dtype in registers and multiply the
    unquantized activations, which skips two quantization launches and keeps the
    activations' precision (as the dense FP8 path does at M = 1). A step whose pairs rarely
    share an expert (batch 1) skips the sort too: tllm.kernels.triton.moe_decode.

References: tllm.kernels.fp8_moe.fp8_fused_experts_ref (W8A8) and tllm.kernels.moe.
fused_experts_ref on the dequantized weights (W8A16)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton import fp8_quant
from tllm.kernels.triton.fp8_moe_configs import fp8_moe_config, is_w8a8
from tllm.kernels.triton.fused_moe import (GemmTile, MoeConfig, PairBlocks, align_pairs,
                                           sum_top_k)
from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot
from tllm.kernels.triton.moe_decode import decode_experts, use_decode_path


@triton.jit
def _scaled_tile_dot(acc, a, a_s, w_ptrs, ws_ptrs, k_ok, EVEN_K: tl.constexpr,
                     A_FP8: tl.constexpr, PER_K_TILE: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_K: tl.constexpr, FAST_ACCUM: tl.constexpr):
    """acc + a . w for one K tile; PER_K_TILE (block scales): the product times its
    activation and weight scales before it is added. FAST_ACCUM (per-channel W8A8, for
    timing the promotion's cost): the tensor cores' own accumulation over all of K."""
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
    if not A_FP8:
        w = w.to(a.dtype)  # e4m3 is exact in bf16, fp16 and fp32
    if PER_K_TILE:
        ws = tl.load(ws_ptrs)
        if A_FP8:
            part = tl.dot(a, w) * a_s[:, None]
        else:
            part = tl.dot(a, w, input_precision=PRECISION)
        acc += part * ws[None, :]
    elif A_FP8 and FAST_ACCUM:
        acc = tl.dot(a, w, acc)
    elif A_FP8:
        # Hopper's fp8 tensor cores keep ~14 bits while they accumulate: promote each tile
        acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
    else:
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _tile_of_program(pid, num_tiles_m, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(m tile, n tile) of program pid: GROUP_M m tiles walk the n tiles together (weight
    reuse in L2), as in fused_moe."""
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_tiles_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


@triton.jit
def _store_pairs(out_ptr, acc, pairs, is_pair, offs_n, N, stride_om, topk_weights_ptr,
                 MUL_WEIGHT: tl.constexpr):
    """The tile's rows to their pairs' rows of out, times the routing weights if asked."""
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=is_pair, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty),
             mask=is_pair[:, None] & (offs_n < N)[None, :])


# the pair and tile counts change with every batch size: one compile serves them all
@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _fp8_expert_gemm_kernel(out_ptr, a_ptr, as_ptr, w_ptr, ws_ptr, sorted_ptr,
                            block_expert_ptr, num_padded_ptr, topk_weights_ptr, N, K,
                            num_pairs, num_tiles_m, stride_am, stride_asm, stride_ask,
                            stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                            stride_om, ROWS_PER_A: tl.constexpr, GATED: tl.constexpr,
                            MUL_WEIGHT: tl.constexpr, A_FP8: tl.constexpr,
                            SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
                            PRECISION: tl.constexpr, FAST_ACCUM: tl.constexpr = False):
    """out[pair, n] = a[pair // ROWS_PER_A] . w[expert(pair), n], scaled, for the pairs of
    one sorted tile (fused_moe._expert_gemm_kernel with fp8 weights). A_FP8: a is fp8 with
    scales as [rows, groups]; else a is unquantized. SCALE_BLOCK_N == 0: weight scales per
    row ws [E, rows]; else per block ws [E, row blocks, K blocks]."""
    pid_m, pid_n = _tile_of_program(tl.program_id(0), num_tiles_m, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # past the last tile in use: the host only knows a bound
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % N).to(tl.int64)  # rows past N are computed, not stored
    offs_kk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None] * stride_am
    w_base = w_ptr + expert * stride_we + rows_n[None, :] * stride_wn  # [BLOCK_K, BLOCK_N]
    ws_base = ws_ptr + expert * stride_wse
    if SCALE_BLOCK_N == 0:
        ws_rows = rows_n * stride_wsn
        ws_rows_up = (N + rows_n) * stride_wsn
    else:
        ws_rows = (rows_n // SCALE_BLOCK_N) * stride_wsn
        ws_rows_up = ((N + rows_n) // SCALE_BLOCK_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a_s = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kk
        k_ok = offs_k < K
        if EVEN_K:
            a = tl.load(a_base + offs_k[None, :], mask=is_pair[:, None], other=0.0)
        else:
            a = tl.load(a_base + offs_k[None, :], mask=is_pair[:, None] & k_ok[None, :],
                        other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
        group = k0 // SCALE_BLOCK_K
        if A_FP8 and SCALE_BLOCK_N != 0:
            a_s = tl.load(as_ptr + a_rows * stride_asm + group * stride_ask, mask=is_pair,
                          other=0.0)
        acc = _scaled_tile_dot(acc, a, a_s, w_base + offs_k[:, None],
                               ws_base + ws_rows + group * stride_wsk, k_ok, EVEN_K, A_FP8,
                               SCALE_BLOCK_N != 0, PRECISION, BLOCK_K, FAST_ACCUM)
        if GATED:
            acc_up = _scaled_tile_dot(acc_up, a, a_s, w_base + N * stride_wn + offs_k[:, None],
                                      ws_base + ws_rows_up + group * stride_wsk, k_ok, EVEN_K,
                                      A_FP8, SCALE_BLOCK_N != 0, PRECISION, BLOCK_K,
                                      FAST_ACCUM)
    if SCALE_BLOCK_N == 0:  # per-channel weights: every scale at the end
        row_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        if A_FP8:
            row_scale = tl.load(as_ptr + a_rows * stride_asm, mask=is_pair, other=0.0)
        acc = acc * row_scale[:, None] * tl.load(ws_base + ws_rows)[None, :]
        if GATED:
            acc_up = acc_up * row_scale[:, None] * tl.load(ws_base + ws_rows_up)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    _store_pairs(out_ptr, acc, pairs, is_pair, offs_n, N, stride_om, topk_weights_ptr,
                 MUL_WEIGHT)


def fp8_expert_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
                    w_scale: torch.Tensor, block: tuple[int, int] | None, blocks: PairBlocks,
                    tile: GemmTile, out_dtype: torch.dtype, group_m: int = 1,
                    rows_per_a: int = 1, gated: bool = False,
                    topk_weights: torch.Tensor | None = None,
                    fast_accum: bool = False) -> torch.Tensor:
    """One grouped GEMM over the sorted pairs: a [P / rows_per_a, K] fp8 with a_scale
    [rows, 1 or K / bk] (W8A8) or unquantized with a_scale None (W8A16); w [E, N (2N if
    gated), K] fp8 with w_scale [E, N, 1] or block scales -> [P, N] out_dtype.
    `fast_accum` (per-channel W8A8 only; benchmarks): no promotion of each K tile."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    k = w.shape[2]
    out = torch.empty(blocks.num_pairs, n, dtype=out_dtype, device=a.device)
    if blocks.num_pairs == 0 or n == 0:
        return out
    block_k = tile.block_k if block is None else min(tile.block_k, block[1])
    scale_block = (0, block_k) if block is None else block
    a_fp8 = a_scale is not None
    a_scale = a_scale if a_fp8 else w_scale  # not read
    weights = topk_weights.reshape(-1) if topk_weights is not None else blocks.num_padded
    grid = (blocks.max_blocks * cdiv(n, tile.block_n),)
    _fp8_expert_gemm_kernel[grid](
        out, a, a_scale, w, w_scale, blocks.sorted_pairs, blocks.block_expert,
        blocks.num_padded, weights, n, k, blocks.num_pairs, blocks.max_blocks, a.stride(0),
        a_scale.stride(0), a_scale.stride(1), w.stride(0), w.stride(1), w_scale.stride(0),
        w_scale.stride(1), w_scale.stride(2), out.stride(0), ROWS_PER_A=rows_per_a,
        GATED=gated, MUL_WEIGHT=topk_weights is not None, A_FP8=a_fp8,
        SCALE_BLOCK_N=scale_block[0], SCALE_BLOCK_K=scale_block[1], BLOCK_M=blocks.block_m,
        BLOCK_N=tile.block_n, BLOCK_K=block_k, GROUP_M=group_m, EVEN_K=k % block_k == 0,
        DOT_FP32=not a_fp8 and needs_fp32_dot(_fp8_expert_gemm_kernel, a.dtype),
        PRECISION=dot_precision(a.dtype), FAST_ACCUM=fast_accum, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
    return out


def _quantize(x: torch.Tensor, block: tuple[int, int] | None):
    if block is None:
        return fp8_quant.quantize_per_token(x)
    return fp8_quant.quantize_per_token_group(x, block[1])


def fp8_fused_experts_triton(hidden: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                             w2: torch.Tensor, w2_scale: torch.Tensor,
                             block: tuple[int, int] | None, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor, expert_start: int = 0,
                             config: MoeConfig | None = None,
                             w8a8: bool | None = None,
                             decode: bool | None = None) -> torch.Tensor:
    """tllm.kernels.fp8_moe.fp8_fused_experts on the Triton kernels (the weights as in its
    Fp8Experts; arguments checked there). `w8a8` None: by the tile size (module docstring).
    `decode`: W8A16 on the sort-free path of tllm.kernels.triton.moe_decode (None: where
    `use_decode_path` says, unless a tile config or W8A8 is asked for)."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    if decode is None:
        decode = (config is None and not w8a8
                  and use_decode_path(num_tokens, top_k, num_experts))
    if decode:
        return decode_experts(hidden, w13, w2, topk_weights, topk_ids, expert_start,
                              w13_scale=w13_scale, w2_scale=w2_scale, block=block)
    cfg = config or fp8_moe_config(num_tokens, top_k, num_experts,
                                   "channel" if block is None else "block")
    if w8a8 is None:
        w8a8 = is_w8a8(cfg)
    blocks = align_pairs(topk_ids, num_experts, cfg.block_m, expert_start)
    gemm = dict(block=block, blocks=blocks, out_dtype=hidden.dtype, group_m=cfg.group_m)
    a, a_scale = _quantize(hidden, block) if w8a8 else (hidden, None)
    inter = fp8_expert_gemm(a, a_scale, w13, w13_scale, tile=cfg.gate_up, rows_per_a=top_k,
                            gated=True, **gemm)
    a, a_scale = _quantize(inter, block) if w8a8 else (inter, None)
    pair_out = fp8_expert_gemm(a, a_scale, w2, w2_scale, tile=cfg.down,
                               topk_weights=topk_weights.float().contiguous(), **gemm)
    return sum_top_k(pair_out, topk_ids, num_experts, expert_start)
