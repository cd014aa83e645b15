"""MXFP4 (the OCP microscaling format GPT-OSS ships its experts in): blocks of 32 FP4 (e2m1)
values that share one power-of-two scale. A weight [rows, K] is stored as `blocks` [rows,
K / 32, 16] uint8, two values a byte (the low nibble first), and `scales` [rows, K / 32]
uint8, an E8M0 exponent (value = fp4 * 2 ** (scale - 127)).

`dequantize_mxfp4` is the CPU path and the reference for the Triton dequant-in-GEMM kernel
(tllm.kernels.triton.swiglu_moe); it matches transformers' own decoder bit for bit."""
from __future__ import annotations

import torch

BLOCK_SIZE = 32      # values per scale
BYTES_PER_BLOCK = 16
SCALE_BIAS = 127
# e2m1 by its 4-bit code: sign bit 3, exponent bits 2-1, mantissa bit 0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless blocks [..., G, 16] and scales [..., G] are uint8 of one shape."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks must be [..., G, {BYTES_PER_BLOCK}] over scales "
                         f"[..., G], got {tuple(blocks.shape)} and {tuple(scales.shape)}")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] and scales [..., G] -> the values [..., G * 32] in `dtype`. Each
    value is looked up in `dtype`, then scaled by ldexp (rounded once to `dtype`)."""
    check_mxfp4(blocks, scales)
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    exponents = scales.to(torch.int32).unsqueeze(-1) - SCALE_BIAS
    return torch.ldexp(table[codes], exponents).to(dtype).flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] (K a multiple of 32) -> (blocks, scales): each block's scale is the
    power of two that brings its largest magnitude to at most 6, each value rounded to the
    nearest e2m1 code. For tests and dummy weights; checkpoints come quantized."""
    if weight.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"the last dim ({weight.shape[-1]}) must be a multiple of {BLOCK_SIZE}")
    groups = weight.float().unflatten(-1, (-1, BLOCK_SIZE))
    peak = groups.abs().amax(-1).clamp_min(2.0 ** -126)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(FP4_VALUES, device=weight.device)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)
