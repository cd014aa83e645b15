"""Dense small-M GEMV: x [M, K] times a row-major weight W [N, K] (bf16 / fp16 / fp32), fp32
accumulation, one launch, no split-K and no atomics. `dense_gemv_silu_mul` multiplies by a
merged [gate | up] weight [2 I, K] and stores silu(g) * u in its epilogue, so batch-1
decode's MLP skips the [M, 2 I] intermediate and the SiLU-and-mul launch. The references are
`dense_gemv_ref` and `dense_gemv_silu_mul_ref` below.

Batch-1 decode reads every weight once for two flops, so what counts is bytes in flight: each
program streams BLOCK_N weight rows (silu_mul: rows j of gate and I + j of up, so one program
has both halves of its outputs) in [BLOCK_N, BLOCK_K] tiles of 16-byte loads along K, loop
pipelined over NUM_STAGES (tl.range), and keeps a [BLOCK_N, BLOCK_K] fp32 accumulator that is
summed across K once, at the end (no shuffles in the loop). x is loaded in the tile's column
layout, so a thread's x values serve all its rows. At M > 1 (up to 4 rows a program) the
weight tile is loaded once and each x row's products are summed along K every iteration.
Rows past N are computed from row N - 1 (a clamped index) and not stored: no masked weight
loads; K that is not a multiple of BLOCK_K takes masked loads. `dense_gemv` adds a bias in
its epilogue (GPT-OSS's and Qwen2's attention projections)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tllm.kernels.triton.dense_gemv_configs import DEFAULT_CONFIGS, DenseGemvConfig

MAX_BLOCK_M = 4   # rows of x a program multiplies; more rows take more programs


@triton.jit
def _load_tile(ptrs, cols, K, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    """A tile along K as fp32; columns past K read as 0 (only when not EVEN_K)."""
    if EVEN_K:
        tile = tl.load(ptrs, eviction_policy=EVICT)
    else:
        tile = tl.load(ptrs, mask=cols < K, other=0.0, eviction_policy=EVICT)
    return tile.to(tl.float32)


@triton.jit
def _dots_one_row(x_ptrs, w_ptrs, up_step, offs_k, K, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                  NUM_STAGES: tl.constexpr):
    """M = 1: x_ptrs [1, BLOCK_K], w_ptrs [BLOCK_N, BLOCK_K] -> ([1, BLOCK_N] gate or plain,
    [1, BLOCK_N] up); full-width accumulators, one sum across K at the end."""
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = (k0 + offs_k)[None, :]
        x = _load_tile(x_ptrs + k0, cols, K, EVEN_K, "evict_last")
        acc_g += _load_tile(w_ptrs + k0, cols, K, EVEN_K, "evict_first") * x
        if GATED:
            acc_u += _load_tile(w_ptrs + up_step + k0, cols, K, EVEN_K, "evict_first") * x
    return tl.sum(acc_g, axis=1)[None, :], tl.sum(acc_u, axis=1)[None, :]


@triton.jit
def _dots_rows(x_ptr, first_row, M, stride_xm, w_ptrs, up_step, offs_k, K,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GATED: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """M > 1: x rows first_row.. -> ([BLOCK_M, BLOCK_N] x 2); each weight tile loaded once
    and summed along K against every x row (a short last tile repeats row M - 1)."""
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_ids = tl.arange(0, BLOCK_M)[:, None]
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = (k0 + offs_k)[None, :]
        wg = _load_tile(w_ptrs + k0, cols, K, EVEN_K, "evict_first")
        if GATED:
            wu = _load_tile(w_ptrs + up_step + k0, cols, K, EVEN_K, "evict_first")
        for m in tl.static_range(BLOCK_M):
            x_row = tl.minimum(first_row + m, M - 1).to(tl.int64)
            x_ptrs = x_ptr + x_row * stride_xm + offs_k[None, :]
            x = _load_tile(x_ptrs + k0, cols, K, EVEN_K, "evict_last")
            acc_g = tl.where(row_ids == m, acc_g + tl.sum(wg * x, axis=1)[None, :], acc_g)
            if GATED:
                acc_u = tl.where(row_ids == m, acc_u + tl.sum(wu * x, axis=1)[None, :], acc_u)
    return acc_g, acc_u


@triton.jit
def _dense_gemv_kernel(out_ptr, x_ptr, w_ptr, bias_ptr, M, N_OUT, K, stride_xm, stride_wn,
                       stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                       EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Program (n tile, m tile): out[m tile, n tile] = x @ W.T (+ bias[n], in fp32 before
    the rounding, as cuBLAS's epilogue), or with GATED silu(g) * u of gate rows n and up
    rows N_OUT + n (g, u rounded to the output dtype first)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_n % N_OUT).to(tl.int64)        # rows past N_OUT are computed, not stored
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    up_step = N_OUT.to(tl.int64) * stride_wn
    if BLOCK_M == 1:
        x_ptrs = x_ptr + pid_m.to(tl.int64) * stride_xm + offs_k[None, :]
        g, u = _dots_one_row(x_ptrs, w_ptrs, up_step, offs_k, K, BLOCK_N, BLOCK_K, GATED,
                             EVEN_K, NUM_STAGES)
    else:
        g, u = _dots_rows(x_ptr, pid_m * BLOCK_M, M, stride_xm, w_ptrs, up_step, offs_k, K,
                          BLOCK_M, BLOCK_N, BLOCK_K, GATED, EVEN_K, NUM_STAGES)
    out_ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        g += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
    if GATED:
        g = g.to(out_ty).to(tl.float32)
        u = u.to(out_ty).to(tl.float32)
        g = g * tl.sigmoid(g) * u
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, g.to(out_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N_OUT))


def _check(x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    if w.dim() != 2 or w.stride(1) != 1:
        raise ValueError(f"{name}: the weight must be a row-major 2-D tensor [N, K], got shape "
                         f"{tuple(w.shape)} strides {w.stride()}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"{name}: x has {x.shape[-1]} features, the weight {w.shape[1]}")
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: x is {x.dtype}, the weight {w.dtype}")


def _launch(x: torch.Tensor, w: torch.Tensor, n_out: int, gated: bool,
            config: DenseGemvConfig | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    cfg = config or DEFAULT_CONFIGS["silu_mul" if gated else "plain"]
    k = w.shape[1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m and n_out:
        block_m = min(triton.next_power_of_2(m), MAX_BLOCK_M)
        block_k = min(cfg.block_k, triton.next_power_of_2(k))
        grid = (triton.cdiv(n_out, cfg.block_n), triton.cdiv(m, block_m))
        _dense_gemv_kernel[grid](
            out, x2, w, w if bias is None else bias, m, n_out, k, x2.stride(0), w.stride(0),
            out.stride(0), BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
            GATED=gated, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return out.view(*x.shape[:-1], n_out)


def dense_gemv(x: torch.Tensor, w: torch.Tensor, config: DenseGemvConfig | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias [N]) for w [N, K]: [..., N] in x's dtype (fp32
    accumulation, the bias added before the rounding)."""
    _check(x, w, "dense_gemv")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.stride(0) != 1
                             or bias.dtype != x.dtype):
        raise ValueError(f"dense_gemv: bias must be a contiguous [{w.shape[0]}] {x.dtype} "
                         f"tensor, got {bias.dtype} {tuple(bias.shape)}")
    return _launch(x, w, w.shape[0], False, config, bias)


def dense_gemv_silu_mul(x: torch.Tensor, w_gate_up: torch.Tensor,
                        config: DenseGemvConfig | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for a merged [gate | up] weight [2 I, K]: [..., I] in
    x's dtype, g and u rounded to it before the SiLU (as the unfused path rounds them)."""
    _check(x, w_gate_up, "dense_gemv_silu_mul")
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"dense_gemv_silu_mul: the merged weight has an odd row count "
                         f"({w_gate_up.shape[0]})")
    return _launch(x, w_gate_up, w_gate_up.shape[0] // 2, True, config)


def dense_gemv_ref(x: torch.Tensor, w: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 x @ w.T (+ bias)."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float())


def dense_gemv_silu_mul_ref(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """float32 silu(g) * u of g, u = x @ [gate | up].T rounded to x's dtype."""
    gate, up = dense_gemv_ref(x, w_gate_up).to(x.dtype).float().chunk(2, dim=-1)
    return F.silu(gate) * up
