"""FP8 GEMMs in Triton: out [M, N] = x [M, K] times an e4m3 weight [N, K], scaled.

`w8a16_mm`: the small-M (decode) kernel. At a few rows a GEMM is a stream of weight bytes,
so this one reads each fp8 weight once, widens it to the activation dtype in registers,
applies the weight scale (per channel, or per 128x128 block) and multiplies the
*unquantized* bf16/fp16 activations: weight-only FP8 (W8A16). Chosen over W8A8 here because
(1) the time is the weight read either way, so the int-to-float work is hidden under it;
(2) no activation quantization pass runs before it (a launch per linear layer, 128 a token
for Llama-3.1-8B, would cost more than the GEMM saves at batch 1); (3) it is more accurate
(the activations keep their 8 mantissa bits). Programs tile N finely (16-64 rows each) so
the weight stream spreads over every SM; when N is too small for that, K is split and a
second kernel sums the partial tiles (in a fixed order: deterministic, no atomics). M = 1
(batch-1 decode) runs a GEMV form of it on the CUDA cores instead of 16-row tensor-core
tiles that would be 15/16 padding.

`fp8_mm`: the W8A8 tiled GEMM for larger M: fp8 x fp8 on the tensor cores with fp32
accumulation (promoted to full fp32 every K tile); per-token x per-channel scales applied
once at the end (for the shapes and dtypes torch._scaled_mm does not take), or
per-token-group x 128x128-block scales applied to each K group's partial product
(DeepSeek-V3 / Qwen3-FP8 checkpoints).

References: tllm.kernels.fp8.w8a16_mm_ref, scaled_mm_ref, block_scaled_mm_ref."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot, next_pow2, num_sms

_MIN_ITERS_PER_SPLIT = 4  # K tiles: a shorter split costs more in partial traffic than it gains
_GEMV_TILE = 8192         # float32 accumulator values of a GEMV program (64 registers a thread)


@dataclass(frozen=True)
class SmallMConfig:
    block_m: int          # 1: the GEMV kernel (M = 1); else a tl.dot tile of >= 16 rows
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@dataclass(frozen=True)
class MmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _w8a16_kernel(out_ptr, part_ptr, x_ptr, w_ptr, ws_ptr, M, N, K, iters_per_split,
                  stride_xm, stride_wn, stride_om, stride_ps, stride_pm, stride_wsn, stride_wsk,
                  SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, IS_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Program (n tile, k split): rows of x [BLOCK_M >= M] against BLOCK_N weight rows over
    its share of K. SCALE_BLOCK_N == 0: per-channel scales ws [N]; else block scales
    ws [ceil(N / SCALE_BLOCK_N), ceil(K / SCALE_BLOCK_K)], applied per K tile
    (BLOCK_K divides SCALE_BLOCK_K, so a tile lies inside one scale block)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)
    rows_m = offs_m % M                       # padding rows re-read row 0..M-1: no mask
    rows_n = (offs_n % N).to(tl.int64)        # rows past N are computed and not stored
    x_base = x_ptr + rows_m[:, None] * stride_xm
    w_base = w_ptr + rows_n[None, :] * stride_wn      # a [BLOCK_K, BLOCK_N] view of W^T
    k_lo = pid_k * iters_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + iters_per_split * BLOCK_K, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + offs_kk
        if EVEN_K:
            x = tl.load(x_base + offs_k[None, :])
            w = tl.load(w_base + offs_k[:, None])
        else:
            x = tl.load(x_base + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
            w = tl.load(w_base + offs_k[:, None], mask=(offs_k < K)[:, None], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
        w = w.to(x.dtype)  # e4m3 is exact in bf16, fp16 and fp32
        if SCALE_BLOCK_N == 0:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        else:
            ws = tl.load(ws_ptr + (rows_n // SCALE_BLOCK_N) * stride_wsn
                         + (k0 // SCALE_BLOCK_K) * stride_wsk)
            acc += tl.dot(x, w, input_precision=PRECISION) * ws[None, :]
    if SCALE_BLOCK_N == 0:
        acc = acc * tl.load(ws_ptr + rows_n * stride_wsn)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :],
                 acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w8a16_gemv_kernel(out_ptr, part_ptr, x_ptr, w_ptr, ws_ptr, N, K, iters_per_split,
                       stride_wn, stride_ps, stride_wsn, stride_wsk,
                       SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       IS_SPLIT: tl.constexpr):
    """M = 1: the same product without tensor cores (a 16-row dot tile would re-read the one
    row 16 times). Products accumulate elementwise in a [BLOCK_K, BLOCK_N] float32 tile,
    summed over K once at the end."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)
    rows_n = (offs_n % N).to(tl.int64)
    w_base = w_ptr + rows_n[None, :] * stride_wn      # a [BLOCK_K, BLOCK_N] view of W^T
    k_lo = pid_k * iters_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + iters_per_split * BLOCK_K, K)
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + offs_kk
        if EVEN_K:
            x = tl.load(x_ptr + offs_k)
            w = tl.load(w_base + offs_k[:, None])
        else:
            x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
            w = tl.load(w_base + offs_k[:, None], mask=(offs_k < K)[:, None], other=0.0)
        w = w.to(tl.float32)
        if SCALE_BLOCK_N != 0:
            w = w * tl.load(ws_ptr + (rows_n // SCALE_BLOCK_N) * stride_wsn
                            + (k0 // SCALE_BLOCK_K) * stride_wsk)[None, :]
        acc += w * x.to(tl.float32)[:, None]
    out = tl.sum(acc, 0)
    if SCALE_BLOCK_N == 0:
        out = out * tl.load(ws_ptr + rows_n * stride_wsn)
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_n, out, mask=offs_n < N)
    else:
        tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _sum_splits_kernel(out_ptr, part_ptr, N, num_splits, stride_om, stride_ps, stride_pm,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, num_splits):
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_mm_kernel(out_ptr, a_ptr, b_ptr, as_ptr, bs_ptr, M, N, K,
                   stride_am, stride_bn, stride_om, stride_asm, stride_ask, stride_bsn,
                   stride_bsk,
                   SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """a [M, K] fp8 times b [N, K] fp8. SCALE_BLOCK_N == 0: a_scale [M] per token, b_scale
    [N] per channel, applied at the end; else a_scale [M, ceil(K / SCALE_BLOCK_K)] per token
    group and b_scale [ceil(N / SCALE_BLOCK_N), ceil(K / SCALE_BLOCK_K)] per block, applied
    to every K tile's partial product."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share their column tiles while those sit in L2
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)
    rows_m = (offs_m % M).to(tl.int64)
    rows_n = (offs_n % N).to(tl.int64)
    a_base = a_ptr + rows_m[:, None] * stride_am
    b_base = b_ptr + rows_n[None, :] * stride_bn      # [BLOCK_K, BLOCK_N], K contiguous
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kk
        if EVEN_K:
            a = tl.load(a_base + offs_k[None, :])
            b = tl.load(b_base + offs_k[:, None])
        else:
            a = tl.load(a_base + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
            b = tl.load(b_base + offs_k[:, None], mask=(offs_k < K)[:, None], other=0.0)
        if SCALE_BLOCK_N == 0:
            # Hopper's fp8 tensor cores keep ~14 bits while they accumulate: promote the sum
            # into the fp32 accumulator every tile, as cuBLASLt does without fast accumulation
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:  # each tile's product is scaled on its own: promoted every tile anyway
            group = k0 // SCALE_BLOCK_K
            a_s = tl.load(as_ptr + rows_m * stride_asm + group * stride_ask)
            b_s = tl.load(bs_ptr + (rows_n // SCALE_BLOCK_N) * stride_bsn + group * stride_bsk)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    if SCALE_BLOCK_N == 0:
        a_s = tl.load(as_ptr + rows_m * stride_asm)
        b_s = tl.load(bs_ptr + rows_n * stride_bsn)
        acc = acc * a_s[:, None] * b_s[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- configurations ----

def small_m_config(m: int, n: int, k: int, device: torch.device,
                   scale_block_k: int | None = None) -> SmallMConfig:
    """The finest N tiling that still leaves two programs per SM: 64 weight rows a program
    for wide layers (gate_up, 28672), 16 for 4096-6144; K is split only when even 16-row
    tiles cannot fill the SMs (small models, tensor-parallel shards). M = 1 takes the GEMV
    kernel (block_m 1), its float32 [block_k, block_n] accumulator held to 8K values."""
    sms = num_sms(device)
    if m == 1 and scale_block_k is None and cdiv(n, 16) >= sms:
        return _gemv_config(n, k)
    for block_n in (64, 32, 16):
        if cdiv(n, block_n) >= 2 * sms:
            break
    block_m = 1 if m == 1 else max(16, next_pow2(m))
    block_k = min(512, _GEMV_TILE // block_n) if block_m == 1 else 256
    if scale_block_k is not None:
        block_k = min(block_k, scale_block_k)
    split = 1
    tiles = cdiv(n, block_n)
    if tiles < sms:
        iters = cdiv(k, block_k)
        split = max(1, min(cdiv(2 * sms, tiles), iters // _MIN_ITERS_PER_SPLIT))
    return SmallMConfig(block_m, block_n, block_k, split)


def _gemv_config(n: int, k: int) -> SmallMConfig:
    """M = 1 on layers wide enough to fill the SMs with 16-row tiles: the best of the H200
    sweep in benchmarks/gpu_fp8.py (2026-12-01; 6144x4096 9.2 us vs 10.6 with the general
    rule, 4096x4096 8.1 vs 9.8, 28672x4096 31.8 vs 35.9, 4096x14336 20.1 vs 27.2)."""
    if n >= 16384:
        return SmallMConfig(1, 16, 256, 1, num_warps=4, num_stages=6)
    if k >= 8192:
        return SmallMConfig(1, 16, 512, 2, num_warps=4, num_stages=4)
    return SmallMConfig(1, 16, 512, 1, num_warps=8, num_stages=3)


def mm_config(m: int, n: int) -> MmConfig:
    """Hopper wgmma tiles: 128x128x128 (8 warps) for prefill-sized M; 64-row tiles below
    (wgmma's minimum M) with narrower N so mid-size batches still spread over the SMs."""
    if m <= 64:
        return MmConfig(64, 64, 128, num_warps=4, num_stages=4)
    if m <= 256:
        return MmConfig(64, 128, 128, num_warps=4, num_stages=4)
    return MmConfig(128, 128, 128, num_warps=8, num_stages=3)


# ---- wrappers ----

def w8a16_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             block: tuple[int, int] | None = None,
             config: SmallMConfig | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, M small) times the fp8 weight [N, K] with per-channel scales
    [N, 1] or, with `block` = (bn, bk), block scales [ceil(N/bn), ceil(K/bk)] -> [M, N] in
    x's dtype. bk must be a power of two >= 16 (any bn)."""
    m, k = x.shape
    n = weight.shape[0]
    _check_gemm(x, weight, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if block is not None:
        _check_block(block)
    cfg = config or small_m_config(m, n, k, x.device, block[1] if block else None)
    if block is not None and block[1] % cfg.block_k:
        raise ValueError(f"block_k {cfg.block_k} must divide the scale block's {block[1]}")
    if cfg.block_m < m:
        raise ValueError(f"block_m {cfg.block_m} is below M = {m}")
    iters = cdiv(k, cfg.block_k)
    per_split = cdiv(iters, cfg.split_k)
    num_splits = cdiv(iters, per_split)
    part = (torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
            if num_splits > 1 else out)
    ws = weight_scale.float()
    if block is None:
        ws = ws.reshape(-1)
        ws_strides, scale_block = (ws.stride(0), 0), (0, 1)
    else:
        ws_strides, scale_block = (ws.stride(0), ws.stride(1)), block
    grid = (cdiv(n, cfg.block_n), num_splits)
    if cfg.block_m == 1:
        _w8a16_gemv_kernel[grid](
            out, part, x, weight, ws, n, k, per_split, weight.stride(0),
            part.stride(0) if num_splits > 1 else 0, *ws_strides,
            SCALE_BLOCK_N=scale_block[0], SCALE_BLOCK_K=scale_block[1], BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, IS_SPLIT=num_splits > 1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        _w8a16_kernel[grid](
            out, part, x, weight, ws, m, n, k, per_split,
            x.stride(0), weight.stride(0), out.stride(0),
            part.stride(0) if num_splits > 1 else 0, part.stride(1) if num_splits > 1 else 0,
            *ws_strides, SCALE_BLOCK_N=scale_block[0], SCALE_BLOCK_K=scale_block[1],
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_K=k % cfg.block_k == 0, IS_SPLIT=num_splits > 1,
            DOT_FP32=needs_fp32_dot(_w8a16_kernel, x.dtype), PRECISION=dot_precision(x.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        block_cols = min(1024, next_pow2(n))
        _sum_splits_kernel[(m, cdiv(n, block_cols))](
            out, part, n, num_splits, out.stride(0), part.stride(0), part.stride(1),
            BLOCK=block_cols, num_warps=4)
    return out


def fp8_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
           weight_scale: torch.Tensor, out_dtype: torch.dtype,
           block: tuple[int, int] | None = None,
           config: MmConfig | None = None) -> torch.Tensor:
    """W8A8: xq [M, K] fp8 times weight [N, K] fp8 -> [M, N] out_dtype. Without `block`:
    x_scale [M, 1] per token, weight_scale [N, 1] per channel. With block = (bn, bk):
    x_scale [M, ceil(K/bk)] per token group, weight_scale [ceil(N/bn), ceil(K/bk)]; bk a
    power of two >= 16."""
    m, k = xq.shape
    n = weight.shape[0]
    _check_gemm(xq, weight, k)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or mm_config(m, n)
    xs, ws = x_scale.float(), weight_scale.float()
    if block is None:
        xs, ws = xs.reshape(-1), ws.reshape(-1)
        strides = (xs.stride(0), 0, ws.stride(0), 0)
        scale_block = (0, 1)
    else:
        _check_block(block)
        strides = (xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1))
        scale_block = block
        cfg = MmConfig(cfg.block_m, cfg.block_n, min(cfg.block_k, block[1]), cfg.group_m,
                       cfg.num_warps, cfg.num_stages)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
    _fp8_mm_kernel[grid](
        out, xq, weight, xs, ws, m, n, k, xq.stride(0), weight.stride(0), out.stride(0),
        *strides, SCALE_BLOCK_N=scale_block[0], SCALE_BLOCK_K=scale_block[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _check_gemm(x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"fp8 GEMM: x {tuple(x.shape)} and weight {tuple(weight.shape)} do "
                         "not multiply")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("fp8 GEMM: x and the weight need contiguous rows")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 GEMM: the weight is {weight.dtype}, not float8_e4m3fn")


def _check_block(block: tuple[int, int]) -> None:
    bn, bk = block
    if bn < 1 or bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8 block scales: block {block} needs bk a power of two >= 16")
