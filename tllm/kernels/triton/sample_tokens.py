"""One token per row drawn from its probabilities with counter-based noise: argmax(p / E),
E ~ Exp(1) from a hash of (the row's seed, its counter, the token id). One program per row
walks the vocabulary in tiles, making the noise in registers: the [rows, vocab] noise tensor
is never written (the torch reference makes it whole, eight elementwise passes over it).
The hash matches `tllm.kernels.sampling_noise` bit for bit; `log` and the division may
round differently by an ulp, which can only matter between near-tied candidates."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels import sampling_noise
from tllm.kernels.sampling_noise import row_keys

_BLOCK_V = 2048
_MIX = tl.constexpr(sampling_noise.MIX)
_COLUMN = tl.constexpr(sampling_noise.COLUMN)
_MASK32 = tl.constexpr(sampling_noise.MASK32)


@triton.jit
def _hash32(x):
    x = ((x >> 16) ^ x) * _MIX
    x = ((x >> 16) ^ x) * _MIX
    return (x >> 16) ^ x


@triton.jit
def _sample_tokens_kernel(out_ptr, probs_ptr, keys_ptr, vocab, stride_p,
                          BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK_V], -1.0, tl.float32)
    best_id = tl.full([BLOCK_V], 0, tl.int64)
    for start in range(0, vocab, BLOCK_V):
        ids = start + tl.arange(0, BLOCK_V).to(tl.int64)
        p = tl.load(probs_ptr + row * stride_p + ids, mask=ids < vocab, other=-1.0)
        column = _hash32(((ids * _COLUMN + 1) & _MASK32).to(tl.uint32))
        bits = _hash32(key ^ column)
        uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = p / -tl.log(uniform)
        better = score > best   # strictly: the first of equal scores stays (lowest id)
        best = tl.where(better, score, best)
        best_id = tl.where(better, ids, best_id)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_id, vocab), axis=0)
    tl.store(out_ptr + row, token)


def sample_tokens(probs: torch.Tensor, seeds: torch.Tensor,
                  counters: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: argmax(probs / Exp(1) noise keyed by (seeds, counters)) per row.
    probs [rows, vocab] float32, contiguous last dimension; the reference is
    `tllm.kernels.sampling_noise.sample_tokens_ref`."""
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError("sample_tokens: probs must be float32 [rows, vocab], contiguous "
                         f"rows; got {probs.dtype} {tuple(probs.shape)}")
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    if rows == 0:
        return out
    keys = row_keys(seeds, counters)
    _sample_tokens_kernel[(rows,)](out, probs, keys, vocab, probs.stride(0),
                                   BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)),
                                   num_warps=4)
    return out
