"""GGUF blocks as the CPU methods take them: gguf's own dequantize, the exact int4 planes of
Q4_0/Q4_1/Q4_K/Q8_0 for torch's int4 kernel, and int8 rows per output channel (the formulas:
tllm.layers.quant.gguf's docstring)."""
from __future__ import annotations

import numpy as np
import torch

from tllm.kernels.gguf import k_scale_min as _k_scale_min

GROUP = 32                      # the int4 kernel's group: Q4_0/Q4_1 blocks, Q4_K sub-blocks
COMPUTE_DTYPE = torch.bfloat16  # what the CPU kernels are vectorised for


def block_shape(qtype: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type."""
    import gguf
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def dequantize_blocks(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """gguf's own dequantization of blocks [rows, blocks, bytes]: float32 [rows, values]."""
    from gguf.quants import dequantize
    import gguf
    rows = blocks.shape[0]
    data = blocks.detach().cpu().reshape(rows, -1).numpy()
    out = dequantize(data, gguf.GGMLQuantizationType[qtype]).reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0].float()


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 nibbles: low nibbles are values 0-15, high nibbles 16-31."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def int4_planes(blocks: torch.Tensor, qtype: str):
    """Blocks [rows, blocks, bytes] -> planes [(q uint8 [rows, K] in 0..15, scale and zero
    float32 [rows, K / 32])], w = sum over planes of (q - 8) * scale + zero (torch's int4
    convention). One plane for the 4-bit types; Q8_0's d * q splits into its low nibble
    (scale d, zero 8d: d * lo) and its high one (scale 16d, zero 0: 16d * hi), both exact."""
    if qtype == "Q8_0":
        d = _f16(blocks, 0)
        q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16)
        rows = blocks.shape[0]
        low = (q & 15).to(torch.uint8).reshape(rows, -1)
        high = ((q >> 4) + 8).to(torch.uint8).reshape(rows, -1)
        d = d.reshape(rows, -1)
        return [(low, d, 8 * d), (high, 16 * d, torch.zeros_like(d))]
    return [int4_groups(blocks, qtype)]


def int4_groups(blocks: torch.Tensor, qtype: str):
    """Blocks [rows, blocks, bytes] of a 4-bit type -> (q uint8 [rows, K] in 0..15, scale and
    zero float32 [rows, K / 32]) with w = (q - 8) * scale + zero."""
    rows = blocks.shape[0]
    d = _f16(blocks, 0)
    if qtype == "Q4_0":                                   # d * (q - 8)
        q, scale, zero = _low_high(blocks[..., 2:]), d, torch.zeros_like(d)
    elif qtype == "Q4_1":                                 # d * q + m
        q, scale = _low_high(blocks[..., 4:]), d
        zero = _f16(blocks, 2) + 8 * d
    elif qtype == "Q4_K":                                 # 8 sub-blocks of 32 per 256 values
        dmin = _f16(blocks, 2)
        sc, mins = _k_scale_min(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(rows, -1, 4, 32)
        q = torch.stack((qs & 15, qs >> 4), dim=-2).reshape(rows, -1, 8, 32)
        scale = d[..., None] * sc.float()
        zero = 8 * scale - dmin[..., None] * mins.float()
    else:
        raise ValueError(f"{qtype} is not a 4-bit GGUF type with a torch int4 kernel")
    return q.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1)


def quantize_rows_int8(weight: torch.Tensor, scale_dtype: torch.dtype = COMPUTE_DTYPE
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (q int8 [N, K], scale float32 [N]), the scale
    already rounded to the kernel's dtype so that q is rounded against the scale it meets."""
    absmax = weight.abs().amax(dim=1).float()
    scale = (absmax / 127).clamp(min=torch.finfo(torch.bfloat16).tiny)
    scale = scale.to(scale_dtype).float()
    q = torch.round(weight.float() / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale
