"""Triton kernels of the batched LoRA op (see tllm.kernels.lora for the maths and the torch
references `lora_shrink_ref` / `lora_expand_ref`).

Each program takes a tile of BLOCK_T consecutive tokens and loops over the adapter slots
present in it (min..max of its slots, skipping absent ones): a prefill tile usually holds one
request, hence one adapter (one tl.dot per K step, as SGMV); a decode tile holds up to
BLOCK_T requests, each adapter's weights then read once per tile (as BGMV, but on tensor
cores). Tokens of other slots are masked to zero. The grid depends only on the number of
tokens, so a CUDA graph captures it: the per-token slots are read from a static buffer.

The shrink splits K (the layer's input features) across programs and sums the float32
partials in a fixed order (deterministic, no atomics); its output is tiny ([T, slices * R])."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot, next_pow2

_BLOCK_T = 16


@triton.jit
def _slot_range(indices_ptr, offs_t, num_tokens):
    """This tile's slots and the range of slot values present (empty when none)."""
    idx = tl.load(indices_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    lo = tl.min(tl.where(idx >= 0, idx, 1 << 30), axis=0)
    hi = tl.max(idx, axis=0)
    return idx, lo, hi


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, indices_ptr, out_ptr, num_tokens, n, k, k_per_split,
                   stride_xt, stride_al, stride_an, stride_os, stride_ot,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    pid_t, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    idx, lo, hi = _slot_range(indices_ptr, offs_t, num_tokens)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for slot in range(lo, hi + 1):
        sel = idx == slot
        if tl.max(sel.to(tl.int32), axis=0) > 0:
            a_base = a_ptr + slot * stride_al
            for k0 in range(k_start, k_end, BLOCK_K):
                kk = k0 + offs_k
                x = tl.load(x_ptr + offs_t[:, None] * stride_xt + kk[None, :],
                            mask=sel[:, None] & (kk < k_end)[None, :], other=0.0)
                a = tl.load(a_base + offs_n[None, :] * stride_an + kk[:, None],
                            mask=(offs_n < n)[None, :] & (kk < k_end)[:, None], other=0.0)
                if DOT_FP32:
                    x, a = x.to(tl.float32), a.to(tl.float32)
                acc += tl.dot(x, a, input_precision=PRECISION)
    tl.store(out_ptr + pid_k * stride_os + offs_t[:, None] * stride_ot + offs_n[None, :], acc,
             mask=(offs_t < num_tokens)[:, None] & (offs_n < n)[None, :])


@triton.jit
def _expand_kernel(out_ptr, h_ptr, b_ptr, indices_ptr, bounds_ptr, num_tokens, n, rank,
                   stride_ot, stride_ht, stride_bl, stride_bn,
                   NUM_SLICES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    pid_t, pid_n = tl.program_id(0), tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    idx, lo, hi = _slot_range(indices_ptr, offs_t, num_tokens)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for slot in range(lo, hi + 1):
        sel = idx == slot
        if tl.max(sel.to(tl.int32), axis=0) > 0:
            b_base = b_ptr + slot * stride_bl
            for s in tl.static_range(NUM_SLICES):
                start = tl.load(bounds_ptr + s)
                end = tl.load(bounds_ptr + s + 1)
                if (start < n0 + BLOCK_N) & (end > n0):  # the tile meets this slice
                    cols = (offs_n >= start) & (offs_n < end) & (offs_n < n)
                    h = tl.load(h_ptr + offs_t[:, None] * stride_ht + s * rank
                                + offs_r[None, :],
                                mask=sel[:, None] & (offs_r < rank)[None, :], other=0.0)
                    b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None],
                                mask=cols[None, :] & (offs_r < rank)[:, None], other=0.0)
                    if DOT_FP32:
                        b = b.to(tl.float32)
                    else:
                        h = h.to(b.dtype)
                    acc += tl.dot(h, b, input_precision=PRECISION)
    rows = (idx >= 0) & (offs_t < num_tokens)
    mask = rows[:, None] & (offs_n < n)[None, :]
    ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :]
    prev = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _num_k_splits(num_tile_programs: int, k: int, block_k: int, device: torch.device) -> int:
    """Enough programs to keep the GPU's memory system busy on a small batch."""
    if device.type != "cuda":
        return 1
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(cdiv(k, block_k), cdiv(target, num_tile_programs)))


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, indices: torch.Tensor,
                num_splits: int | None = None) -> torch.Tensor:
    """h [T, num_slices * R] float32 = each token's x @ A[slot].T (0 where slot is -1).
    `num_splits` of K (default: by the device's size)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_tokens, k = x.shape
    n = a_stack.shape[1]
    block_n = min(64, max(16, next_pow2(n)))
    block_k = 64 if x.device.type != "cuda" else 128
    tiles = (cdiv(num_tokens, _BLOCK_T), cdiv(n, block_n))
    splits = num_splits or _num_k_splits(tiles[0] * tiles[1], k, block_k, x.device)
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k
    splits = cdiv(k, k_per_split)
    partial = torch.empty(splits, num_tokens, n, dtype=torch.float32, device=x.device)
    if num_tokens:
        _shrink_kernel[(*tiles, splits)](
            x, a_stack, indices, partial, num_tokens, n, k, k_per_split, x.stride(0),
            a_stack.stride(0), a_stack.stride(1), partial.stride(0), partial.stride(1),
            BLOCK_T=_BLOCK_T, BLOCK_N=block_n, BLOCK_K=block_k,
            PRECISION=dot_precision(x.dtype), DOT_FP32=needs_fp32_dot(_shrink_kernel, x.dtype))
    return partial[0] if splits == 1 else partial.sum(0)


def lora_expand(out: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor,
                indices: torch.Tensor, bounds: torch.Tensor, num_slices: int) -> torch.Tensor:
    """out [T, N] += h's slice s @ B[slot, slice s rows].T for each slice (in place)."""
    num_tokens, n = out.shape
    rank = b_stack.shape[2]
    block_n = 64
    if num_tokens:
        grid = (cdiv(num_tokens, _BLOCK_T), cdiv(n, block_n))
        _expand_kernel[grid](
            out, h, b_stack, indices, bounds, num_tokens, n, rank, out.stride(0), h.stride(0),
            b_stack.stride(0), b_stack.stride(1), NUM_SLICES=num_slices, BLOCK_T=_BLOCK_T,
            BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(rank)),
            PRECISION=dot_precision(b_stack.dtype),
            DOT_FP32=needs_fp32_dot(_expand_kernel, b_stack.dtype))
    return out
