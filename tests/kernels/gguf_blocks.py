"""Random GGUF blocks of any type the kernels take: random bytes (every nibble, high bit and
packed 6-bit scale pattern occurs) with the fp16 scales set to finite values of a weight's
size (d of either sign, a positive dmin), so no NaN or inf can hide a wrong decode."""
from __future__ import annotations

import numpy as np
import torch

from tllm.kernels.gguf import BLOCK_BYTES

# byte offsets of the fp16 scales in a block: d (and m / dmin) first, Q6_K's d last
_F16_OFFSETS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """uint8 [rows, cols / values per block, bytes per block]."""
    rng = np.random.default_rng(seed)
    nbytes, values = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    for i, offset in enumerate(_F16_OFFSETS[qtype]):
        sign = rng.choice([-1.0, 1.0], raw.shape[:2]) if i == 0 else 1.0
        scale = (sign * rng.uniform(0.5, 2.0, raw.shape[:2]) * 1e-2).astype(np.float16)
        raw[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return torch.from_numpy(raw).to(device)
