"""Counter-based random numbers for sampling: the noise of row r at token t is a hash of
(the row's seed, the row's counter, t), so a request's samples depend on its own seed and
position only, never on which other rows share the batch or in what order, and no
generator state is kept (or looped over) per request. The sampler draws a token as
argmax(p / E) with E ~ Exp(1) (the Gumbel-max trick in its exponential form).

The hash is a 32-bit integer mixer (two multiply-xorshift rounds), written here with int64
tensors masked to 32 bits, which the Triton kernel (tllm/kernels/triton/sample_tokens.py)
computes with uint32 arithmetic: the two agree bit for bit. This file is the reference."""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX = 0x45D9F3B          # the multiplier of both rounds (< 2^27: products fit in int64)
COLUMN = 0x9E3779B1      # spreads the token ids before they meet the row's key
_INV_2_24 = 1.0 / (1 << 24)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit mixer of int64 values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * MIX) & MASK32
    x = (((x >> 16) ^ x) * MIX) & MASK32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from its 64-bit seed and its counter (the position of the
    token being drawn, < 2^32)."""
    key = hash32(seeds & MASK32)
    key = hash32(key ^ ((seeds >> 32) & MASK32))
    return hash32(key ^ (counters & MASK32))


def column_keys(vocab_size: int, device) -> torch.Tensor:
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return hash32((ids * COLUMN + 1) & MASK32)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor,
                      vocab_size: int) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) noise, each row keyed by (seed, counter)."""
    bits = hash32(row_keys(seeds, counters)[:, None]
                  ^ column_keys(vocab_size, seeds.device)[None, :])
    # the top 24 bits as a uniform in (0, 1): exact in float32, never 0 or 1
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * _INV_2_24
    return -torch.log(uniform)


def sample_tokens_ref(probs: torch.Tensor, seeds: torch.Tensor,
                      counters: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) per row (int64 [rows]); probs [rows, vocab] float32 with at
    least one positive entry a row."""
    return (probs / exponential_noise(seeds, counters, probs.shape[1])).argmax(dim=-1)
