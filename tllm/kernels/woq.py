"""Weight-only integer quantization (W4A16 / W8A16) in plain torch: the run-time packed form
every AWQ, GPTQ and online-quantized layer is repacked into, its dequantization and product
(the references of tllm.kernels.triton.w4a16_gemm, and the CPU path), and round-to-nearest
quantization for online use.

The run-time form of a weight [N, K] with `bits` in (4, 8) and groups of `group` input
features (one scale and one zero point per output row and group):
  qweight  int32 [N, K / pack], pack = 32 / bits: row n holds its K values (unsigned,
           0 .. 2^bits - 1) in chunks of `chunk_words` words (16 where K allows): in a chunk
           starting at value c, bit-field j (bits j*bits ..) of word w holds value
           c + j * chunk_words + w. So each bit-field of a run of words is a contiguous run
           of K: the kernels unpack one field of a whole tile with one mask (no shift for
           most fields) and meet it with a contiguous slice of x. Rows along K are what the
           decode GEMV streams, with 16-byte loads.
  scales   [K / group, N] (float16 on the GPU, float32 on the CPU)
  zeros    [K / group, N], same dtype: the integer zero point z (exact in float16)
  w[n, k] = (q[n, k] - z[k // group, n]) * s[k // group, n]
Act-order checkpoints (GPTQ desc_act) are stored with their input features sorted by group;
the layer then gathers x's columns by `perm` before the product (x[:, perm])."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


def pack_factor(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"weight-only quantization: bits must be 4 or 8, got {bits}")
    return 32 // bits


@dataclass(frozen=True)
class WoqLayout:
    bits: int
    group: int         # input features per scale (the layer's K for one group per row)
    chunk_words: int   # words per interleave chunk (interleave_words)

    @property
    def pack(self) -> int:
        return pack_factor(self.bits)

    @property
    def chunk(self) -> int:
        """Values per interleave chunk: the kernels' K tile."""
        return self.chunk_words * self.pack


def interleave_words(k: int, bits: int) -> int:
    """The largest chunk of 16, 8, 4 or 2 words whose values divide K and number >= 16."""
    pack = pack_factor(bits)
    for words in (16, 8, 4, 2):
        if k % (words * pack) == 0 and words * pack >= 16:
            return words
    raise ValueError(f"{k} input features cannot be packed at {bits} bits (a multiple of 16 "
                     "is needed)")


def pack_rows(q: torch.Tensor, layout: WoqLayout) -> torch.Tensor:
    """Values [N, K] -> the run-time qweight int32 [N, K / pack] (interleaved chunks)."""
    n, k = q.shape
    chunks = q.reshape(n, k // layout.chunk, layout.pack, layout.chunk_words).transpose(2, 3)
    return pack_along_last(chunks, layout.bits).reshape(n, -1)


def unpack_rows(qweight: torch.Tensor, layout: WoqLayout) -> torch.Tensor:
    """The run-time qweight -> int32 values [N, K] in feature order."""
    n = qweight.shape[0]
    fields = unpack_along_last(qweight.reshape(n, -1, layout.chunk_words), layout.bits)
    chunks = fields.reshape(n, -1, layout.chunk_words, layout.pack).transpose(2, 3)
    return chunks.reshape(n, -1)


def pack_along_last(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [..., L] (any integer dtype, 0 .. 2^bits - 1) -> int32 [..., L / pack],
    value i in bits (i % pack) * bits of word i // pack."""
    pack = pack_factor(bits)
    if q.shape[-1] % pack:
        raise ValueError(f"cannot pack {q.shape[-1]} values in words of {pack}")
    parts = q.to(torch.int64).reshape(*q.shape[:-1], -1, pack)
    shifts = torch.arange(pack, device=q.device, dtype=torch.int64) * bits
    words = (parts << shifts).sum(dim=-1)
    # two's complement: values with the top bit set are negative int32
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_along_last(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> int32 values [..., W * pack] (the inverse of pack_along_last)."""
    pack = pack_factor(bits)
    shifts = torch.arange(pack, device=words.device, dtype=torch.int32) * bits
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*words.shape[:-1], -1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               layout: WoqLayout) -> torch.Tensor:
    """The run-time form -> float32 [N, K] (features in stored order)."""
    q = unpack_rows(qweight, layout).float()                             # [N, K]
    s = scales.float().t().repeat_interleave(layout.group, dim=1)        # [N, K]
    z = zeros.float().t().repeat_interleave(layout.group, dim=1)
    return (q - z) * s


def woq_mm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, layout: WoqLayout) -> torch.Tensor:
    """x [M, K] (stored feature order) times the dequantized weight, in float32."""
    return x.float() @ dequantize(qweight, scales, zeros, layout).t()


def quantize_rtn(weight: torch.Tensor, bits: int, group: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric quantization per group of `group` input features, as
    AutoAWQ's pseudo_quantize_tensor does (scale = (max - min) / (2^bits - 1), zero =
    round(-min / scale)): (q uint8 [N, K], scales float32 [K / group, N], zeros float32
    [K / group, N]); the scales are rounded to float16 first, the form they are kept in."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"group size {group} does not divide the {k} input features")
    max_int = 2 ** bits - 1
    w = weight.float().reshape(n, k // group, group)
    w_max, w_min = w.amax(dim=-1), w.amin(dim=-1)
    scales = ((w_max - w_min).clamp(min=1e-5) / max_int).half().float()
    zeros = (-torch.round(w_min / scales)).clamp(0, max_int)
    q = (torch.round(w / scales[..., None]) + zeros[..., None]).clamp(0, max_int)
    return q.reshape(n, k).to(torch.uint8), scales.t().contiguous(), zeros.t().contiguous()
