"""Triton kernels of the batched LoRA op (see tllm.kernels.lora for the maths and the torch
references `lora_shrink_ref` / `lora_expand_ref`, tllm.kernels.lora_batch for the step's
token grouping `LoraBatch`).

Both kernels take one program per (tile, column block): a tile is up to LORA_BLOCK_T tokens
of one adapter slot (grouped once per step, shared by every layer), so a program reads one
adapter's A or B block once, for all its tokens, on tensor cores (SGMV for a prefill, where a
request's tokens fill whole tiles; BGMV-like for decode, a tile per adapter). Tiles past the
step's last one exit at once, so the grid depends only on the number of tokens (CUDA graphs
capture it) and a step without adapters costs two near-empty launches per layer.

The shrink splits K (the layer's input features) across programs, writing float32 partials
[splits, T, slices * R]; the expand sums them in a fixed order as it loads its tile's rows of
h (deterministic, no atomics, no extra pass), then adds h @ B.T into the base output in place,
per merged slice."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.lora_batch import LORA_BLOCK_T, LoraBatch, LoraKernelConfig
from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot, next_pow2, num_sms

_DEFAULT = LoraKernelConfig()
_MAX_SPLITS = 32  # the expand loads every partial of its rows at once


@triton.jit
def _tile(slots_ptr, tokens_ptr, BLOCK_T: tl.constexpr):
    """This program's tile: its slot (-1: past the step's tiles), its token ids (int64) and
    which of its rows hold a token. Both loads go out before anything waits on them."""
    tile = tl.program_id(0)
    slot = tl.load(slots_ptr + tile)
    tokens = tl.load(tokens_ptr + tile * BLOCK_T + tl.arange(0, BLOCK_T))
    return slot, tokens.to(tl.int64), tokens >= 0


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, tokens_ptr, out_ptr, n, k, k_per_split,
                   stride_xt, stride_al, stride_an, stride_os, stride_ot,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    pid_n, pid_k = tl.program_id(1), tl.program_id(2)
    slot, tokens, valid = _tile(slots_ptr, tokens_ptr, BLOCK_T)
    if slot < 0:  # past the step's tiles
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + offs_k
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + kk[None, :],
                    mask=valid[:, None] & (kk < k_end)[None, :], other=0.0)
        a = tl.load(a_base + offs_n[None, :] * stride_an + kk[:, None],
                    mask=(offs_n < n)[None, :] & (kk < k_end)[:, None], other=0.0)
        if DOT_FP32:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(out_ptr + pid_k * stride_os + tokens[:, None] * stride_ot + offs_n[None, :], acc,
             mask=valid[:, None] & (offs_n < n)[None, :])


@triton.jit
def _load_h(h_ptr, tokens, valid, col0, rank, num_splits, stride_hs, stride_ht,
            BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """The tile's rows of one slice of h: the sum of the shrink's K partials, loaded in one
    go (a loop of dependent loads would cost a memory round trip each)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = (h_ptr + offs_s[:, None, None] * stride_hs + tokens[None, :, None] * stride_ht
            + col0 + offs_r[None, None, :])
    mask = ((offs_s < num_splits)[:, None, None] & valid[None, :, None]
            & (offs_r < rank)[None, None, :])
    return tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=0)


@triton.jit
def _expand_kernel(out_ptr, h_ptr, b_ptr, slots_ptr, tokens_ptr, n, rank, num_splits,
                   stride_ot, stride_hs, stride_ht, stride_bl, stride_bn,
                   NUM_SLICES: tl.constexpr, SLICE_1: tl.constexpr, SLICE_2: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_S: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """SLICE_1, SLICE_2: where the second and third slices begin (compile-time: a layer's
    slices never change, and a runtime bound would cost a load and a wait)."""
    pid_n = tl.program_id(1)
    slot, tokens, valid = _tile(slots_ptr, tokens_ptr, BLOCK_T)
    if slot < 0:  # past the step's tiles
        return
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    mask = valid[:, None] & (offs_n < n)[None, :]
    ptrs = out_ptr + tokens[:, None] * stride_ot + offs_n[None, :]
    prev = tl.load(ptrs, mask=mask, other=0.0)  # in flight while the deltas are computed
    b_base = b_ptr + slot.to(tl.int64) * stride_bl
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(NUM_SLICES):
        start = 0 if s == 0 else (SLICE_1 if s == 1 else SLICE_2)
        end = n if s == NUM_SLICES - 1 else (SLICE_1 if s == 0 else SLICE_2)
        if (start < n0 + BLOCK_N) & (end > n0):  # the column block meets this slice
            cols = (offs_n >= start) & (offs_n < end) & (offs_n < n)
            h = _load_h(h_ptr, tokens, valid, s * rank, rank, num_splits, stride_hs,
                        stride_ht, BLOCK_S, BLOCK_R)
            b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None],
                        mask=cols[None, :] & (offs_r < rank)[:, None], other=0.0)
            if DOT_FP32:
                b = b.to(tl.float32)
            else:
                h = h.to(b.dtype)
            acc += tl.dot(h, b, input_precision=PRECISION)
    tl.store(ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def shrink_splits(num_tiles: int, n_blocks: int, k: int, block_k: int, programs: int) -> int:
    """K splits that bring the shrink to about `programs` programs (at least one K block
    each): a decode step has few tiles, and one program per tile would leave most SMs idle."""
    return max(1, min(cdiv(k, block_k), _MAX_SPLITS, cdiv(programs, num_tiles * n_blocks)))


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, batch: LoraBatch,
                num_splits: int | None = None,
                config: LoraKernelConfig | None = None) -> torch.Tensor:
    """Float32 partials [splits, T, num_slices * R] of each token's x @ A[slot].T; their sum
    over splits is h (rows of tokens without an adapter are left unwritten)."""
    config = config or _DEFAULT
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_tokens, k = x.shape
    n = a_stack.shape[1]
    block_n = min(128, max(16, next_pow2(n)))
    block_k = config.shrink_block_k
    grid_tiles, n_blocks = batch.tile_bound(num_tokens), cdiv(n, block_n)
    programs = config.shrink_programs_per_sm * num_sms(x.device)
    splits = num_splits or shrink_splits(grid_tiles, n_blocks, k, block_k, programs)
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k
    splits = cdiv(k, k_per_split)
    partial = torch.empty(splits, num_tokens, n, dtype=torch.float32, device=x.device)
    if num_tokens:
        _shrink_kernel[(grid_tiles, n_blocks, splits)](
            x, a_stack, batch.tile_slots, batch.tile_tokens, partial, n, k, k_per_split,
            x.stride(0), a_stack.stride(0), a_stack.stride(1), partial.stride(0),
            partial.stride(1), BLOCK_T=LORA_BLOCK_T, BLOCK_N=block_n, BLOCK_K=block_k,
            PRECISION=dot_precision(x.dtype), DOT_FP32=needs_fp32_dot(_shrink_kernel, x.dtype),
            num_warps=config.num_warps)
    return partial


def lora_expand(out: torch.Tensor, partial: torch.Tensor, b_stack: torch.Tensor,
                batch: LoraBatch, bounds: tuple[int, ...],
                config: LoraKernelConfig | None = None) -> torch.Tensor:
    """out [T, N] += (sum of the shrink's partials) slice s @ B[slot, slice s rows].T, for
    each slice (in place). `partial` [splits, T, slices * R] float32 (h itself: h[None]);
    `bounds` the slices' output offsets, [0, ..., N] (at most 3 slices)."""
    config = config or _DEFAULT
    num_tokens, n = out.shape
    num_slices = len(bounds) - 1
    if not 1 <= num_slices <= 3 or bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"bounds {bounds}: 1 to 3 slices from 0 to {n} expected")
    starts = list(bounds[1:-1]) + [n] * (3 - num_slices)
    rank = b_stack.shape[2]
    block_n = config.expand_block_n
    if num_tokens:
        grid = (batch.tile_bound(num_tokens), cdiv(n, block_n))
        _expand_kernel[grid](
            out, partial, b_stack, batch.tile_slots, batch.tile_tokens, n, rank,
            partial.shape[0], out.stride(0), partial.stride(0), partial.stride(1),
            b_stack.stride(0), b_stack.stride(1), NUM_SLICES=num_slices, SLICE_1=starts[0],
            SLICE_2=starts[1], BLOCK_T=LORA_BLOCK_T, BLOCK_N=block_n,
            BLOCK_R=max(16, next_pow2(rank)), BLOCK_S=next_pow2(partial.shape[0]),
            PRECISION=dot_precision(b_stack.dtype),
            DOT_FP32=needs_fp32_dot(_expand_kernel, b_stack.dtype), num_warps=config.num_warps)
    return out
