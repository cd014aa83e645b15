"""GGUF block formats in the layout the GPU kernels read (tllm.kernels.triton.gguf_gemm), the
one-time repack into it, and the torch reference of the kernels.

A GGUF tensor lies as [rows, blocks, bytes per block], every block an array of structs (an
fp16 scale, packed scales, nibbles, high bits). At load it is repacked, once, into planes of
one kind each ("structure of arrays"), each row-major [rows, ...], so that a kernel tile of
rows x K values reads whole cache lines of every plane. All types then share one value order,
that of Q4_0: in each group of 32 values, nibble byte j holds value j (low nibble) and value
16 + j (high nibble). A kernel decodes a tile as two halves, the low and the high nibbles,
each [rows, groups, 16], and loads the activations at the matching positions.

Planes (uint8 unless said; G = K / 32 groups of 32 values a row):
- qs: the low 4 bits of every value [N, K / 2] (Q8_0: its int8 values [N, K]);
- qh: the 5th bit (Q5_0, Q5_1, Q5_K: int32 [N, G], bit j for value j of the group) or the
  top 2 bits (Q6_K: int32 [N, 2G], values 0-15 then 16-31 of a group, 2 bits each);
- d: fp16 scale per group [N, G] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or per 256-value super-block
  [N, K / 256] (Q4_K, Q5_K, Q6_K); dmin: fp16 [N, K / 256] (Q4_K, Q5_K);
- sc: the 6-bit sub-block scales [N, G] (Q4_K, Q5_K) or int8 scales per 16 values
  [N, K / 16] (Q6_K); m: fp16 minimum per group (Q4_1, Q5_1) or 6-bit sub-block minimums
  [N, G] (Q4_K, Q5_K).
The K-quants' 12 packed scale bytes become 16 (sc and m a byte each): Q4_K takes 148 bytes
per 256 values instead of 144, Q5_K 180 instead of 176; the others keep the file's size. The
planes lie in one flat uint8 buffer (`pack_planes`; `planes_view` reads it back), so a tied
embedding and LM head share the repacked weight as they shared the blocks.

Values, as gguf.quants.dequantize computes them in float32 (and `dequantize_planes` here,
bit for bit): Q4_0 d * (q - 8); Q4_1 d * q + m; Q5_0 d * (q - 16); Q5_1 d * q + m; Q8_0 q * d;
Q4_K and Q5_K (d * sc) * q - dmin * m per 32; Q6_K (d * sc) * (q - 32) per 16."""
from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
GROUP = 32          # values a group: a 32-block, or a K-quant's sub-block (Q6_K: two scales)
SUPER = 256         # values a K-quant super-block
_ALIGN = 256        # bytes: every plane starts on its own aligned offset in the buffer
_CHUNK_VALUES = 2 ** 24  # values repacked at a time (the LM head of a 128K vocabulary: 2^29)

# (bytes per block, values per block) as gguf.GGML_QUANT_SIZES has them
BLOCK_BYTES = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
               "Q8_0": (34, 32), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


def _plane_specs(qtype: str, k: int) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, elements a row) of each plane of `qtype` for rows of k values."""
    g, s = k // GROUP, k // SUPER
    qs = ("qs", torch.int8, k) if qtype == "Q8_0" else ("qs", torch.uint8, k // 2)
    specs = {
        "Q4_0": [("d", torch.float16, g)],
        "Q4_1": [("d", torch.float16, g), ("m", torch.float16, g)],
        "Q5_0": [("qh", torch.int32, g), ("d", torch.float16, g)],
        "Q5_1": [("qh", torch.int32, g), ("d", torch.float16, g), ("m", torch.float16, g)],
        "Q8_0": [("d", torch.float16, g)],
        "Q4_K": [("d", torch.float16, s), ("dmin", torch.float16, s), ("sc", torch.uint8, g),
                 ("m", torch.uint8, g)],
        "Q5_K": [("qh", torch.int32, g), ("d", torch.float16, s), ("dmin", torch.float16, s),
                 ("sc", torch.uint8, g), ("m", torch.uint8, g)],
        "Q6_K": [("qh", torch.int32, 2 * g), ("d", torch.float16, s), ("sc", torch.int8, 2 * g)],
    }[qtype]
    return [qs, *specs]


@dataclass(frozen=True)
class GgufPlanes:
    """One weight [n, k] of GGML type `qtype` as planes (module docstring); absent planes
    are None."""

    qtype: str
    n: int
    k: int
    qs: torch.Tensor
    qh: torch.Tensor | None = None
    d: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    m: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.qs.device


def _offsets(qtype: str, n: int, k: int) -> tuple[list[tuple[str, torch.dtype, int, int]], int]:
    """Each plane's (name, dtype, elements a row, byte offset) in the flat buffer; its size."""
    out, offset = [], 0
    for name, dtype, elems in _plane_specs(qtype, k):
        out.append((name, dtype, elems, offset))
        nbytes = n * elems * dtype.itemsize
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return out, offset


def planes_view(buffer: torch.Tensor, qtype: str, n: int, k: int) -> GgufPlanes:
    """The planes inside a flat buffer made by `pack_planes` (views: no copy)."""
    specs, size = _offsets(qtype, n, k)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != size:
        raise ValueError(f"GGUF {qtype} planes of [{n}, {k}] take {size} bytes, got "
                         f"{buffer.dtype} {tuple(buffer.shape)}")
    planes = {name: buffer[offset:offset + n * elems * dtype.itemsize].view(dtype)
              .view(n, elems) for name, dtype, elems, offset in specs}
    return GgufPlanes(qtype, n, k, **planes)


def pack_planes(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF blocks [rows, blocks, bytes] -> the flat uint8 buffer of their planes (on the
    blocks' device)."""
    if qtype not in KERNEL_TYPES:
        raise ValueError(f"GGUF {qtype} has no GPU kernel; kernel types: {KERNEL_TYPES}")
    if blocks.dim() != 3 or blocks.shape[2] != BLOCK_BYTES[qtype][0]:
        raise ValueError(f"GGUF {qtype} blocks must be [rows, blocks, "
                         f"{BLOCK_BYTES[qtype][0]}], got {tuple(blocks.shape)}")
    n, k = blocks.shape[0], blocks.shape[1] * BLOCK_BYTES[qtype][1]
    _, size = _offsets(qtype, n, k)
    buffer = torch.zeros(size, dtype=torch.uint8, device=blocks.device)
    view = planes_view(buffer, qtype, n, k)
    chunk = max(1, _CHUNK_VALUES // k)   # rows a step: the unpacked values stay ~64 MB
    for start in range(0, n, chunk):
        part = _unpacked_planes(blocks[start:start + chunk].contiguous(), qtype)
        for name, plane in part.items():
            target = getattr(view, name)
            target[start:start + chunk] = plane.reshape(-1, target.shape[1]).to(target.dtype)
    return buffer


# ---- blocks -> integer values and scales ----

def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values, GGUF's 32-block order: low nibbles first."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian 4 bytes [..., 4] -> int64 [...]."""
    b = b.long()
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _bits32(word: torch.Tensor) -> torch.Tensor:
    """int64 [...] -> its 32 low bits [..., 32], bit j at j."""
    return (word[..., None] >> torch.arange(32, device=word.device)) & 1


def k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K block (12 bytes), as gguf unpacks them."""
    s = packed.reshape(*packed.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=-1)
    mins = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=-1)
    return sc, mins


def block_values(blocks: torch.Tensor, qtype: str) -> dict[str, torch.Tensor]:
    """Blocks [rows, blocks, bytes] -> {"q": integer values [rows, K] (int16, as stored:
    0..15 / 0..31 / 0..63, Q8_0 -128..127), and the scales as the planes keep them}."""
    rows = blocks.shape[0]
    b = blocks
    if qtype in ("Q4_0", "Q5_0", "Q8_0"):
        out = {"d": _f16(b, 0)}
        body = 2
    elif qtype in ("Q4_1", "Q5_1"):
        out = {"d": _f16(b, 0), "m": _f16(b, 2)}
        body = 4
    if qtype == "Q8_0":
        out["q"] = b[..., 2:].contiguous().view(torch.int8).short()
    elif qtype in ("Q4_0", "Q4_1"):
        out["q"] = _nibbles(b[..., body:]).short()
    elif qtype in ("Q5_0", "Q5_1"):
        high = _bits32(_u32(b[..., body:body + 4]))
        out["q"] = (_nibbles(b[..., body + 4:]).long() | (high << 4)).short()
    elif qtype in ("Q4_K", "Q5_K"):
        out = _k_quant_values(b, qtype)
    else:
        out = _q6_k_values(b)
    out["q"] = out["q"].reshape(rows, -1)
    return out


def _k_quant_values(b: torch.Tensor, qtype: str) -> dict[str, torch.Tensor]:
    rows, nblocks = b.shape[:2]
    sc, mins = k_scale_min(b[..., 4:16])
    qs = b[..., 16:144] if qtype == "Q4_K" else b[..., 48:176]
    qs = qs.reshape(rows, nblocks, 4, 1, 32)       # 4 chunks of 64 values: lo, then hi nibbles
    q = torch.cat((qs & 15, qs >> 4), dim=3).reshape(rows, nblocks, 8, 32).int()
    if qtype == "Q5_K":                            # bit i of byte l: value l of sub-block i
        qh = b[..., 16:48].int().reshape(rows, nblocks, 1, 32)
        q = q | (((qh >> torch.arange(8, device=b.device)[:, None]) & 1) << 4)
    return {"q": q.short(), "d": _f16(b, 0), "dmin": _f16(b, 2), "sc": sc, "m": mins}


def _q6_k_values(b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Value 32r + l of a block, r = 4h + 2s + t: nibble s of ql byte 64h + 32t + l, bits
    2(2s + t) of qh byte 32h + l (gguf's Q6_K.dequantize_blocks)."""
    rows, nblocks = b.shape[:2]
    ql = b[..., :128].reshape(rows, nblocks, 2, 1, 2, 32)
    low = torch.cat((ql & 15, ql >> 4), dim=3).int()                     # [.., h, s, t, l]
    qh = b[..., 128:192].int().reshape(rows, nblocks, 2, 1, 32)
    shifts = 2 * torch.arange(4, device=b.device)[:, None]
    high = ((qh >> shifts) & 3).reshape(rows, nblocks, 2, 2, 2, 32)      # p = 2s + t
    q = (low | (high << 4)).reshape(rows, nblocks, 256)
    return {"q": q.short(), "d": _f16(b, 208), "sc": b[..., 192:208].contiguous().view(torch.int8)}


def _to_int32(word: torch.Tensor) -> torch.Tensor:
    """An unsigned 32-bit word held in int64 -> the int32 with the same bits."""
    return (((word + 2 ** 31) % 2 ** 32) - 2 ** 31).to(torch.int32)


def _unpacked_planes(blocks: torch.Tensor, qtype: str) -> dict[str, torch.Tensor]:
    values = block_values(blocks, qtype)
    rows = blocks.shape[0]
    q = values.pop("q").int()
    groups = q.reshape(rows, -1, 2, 16)                   # each 32: values 0-15, 16-31
    planes = dict(values)
    if qtype == "Q8_0":
        planes["qs"] = q
    else:
        low = groups & 15
        planes["qs"] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(rows, -1)
    if qtype in ("Q5_0", "Q5_1", "Q5_K"):
        bits = ((groups >> 4) & 1).reshape(rows, -1, 32)
        planes["qh"] = _to_int32((bits << torch.arange(32, device=q.device)).sum(-1))
    elif qtype == "Q6_K":
        top = (groups >> 4) & 3                            # [rows, G, 2, 16]
        planes["qh"] = _to_int32((top << (2 * torch.arange(16, device=q.device))).sum(-1))
    return planes


# ---- the reference ----

def plane_values(planes: GgufPlanes) -> torch.Tensor:
    """The integer values [n, k] (int64) the planes hold."""
    n = planes.n
    qs = planes.qs.long()
    if planes.qtype == "Q8_0":
        return qs
    q = _nibbles(qs.reshape(n, -1, 16))                    # [n, G, 32]
    if planes.qtype in ("Q5_0", "Q5_1", "Q5_K"):
        q = q | (_bits32(planes.qh.long() & 0xFFFFFFFF) << 4)
    elif planes.qtype == "Q6_K":
        words = planes.qh.long().reshape(n, -1, 2) & 0xFFFFFFFF
        top = (words[..., None] >> (2 * torch.arange(16, device=qs.device))) & 3
        q = q | (top.reshape(n, -1, 32) << 4)
    return q.reshape(n, -1)


def dequantize_planes(planes: GgufPlanes) -> torch.Tensor:
    """float32 [n, k]: the weight, equal to gguf.quants.dequantize of the original blocks."""
    n, qtype = planes.n, planes.qtype
    q = plane_values(planes).float().reshape(n, -1, GROUP)
    d = planes.d.float()
    if qtype in ("Q4_0", "Q5_0"):
        w = d[..., None] * (q - (8 if qtype == "Q4_0" else 16))
    elif qtype in ("Q4_1", "Q5_1"):
        w = d[..., None] * q + planes.m.float()[..., None]
    elif qtype == "Q8_0":
        w = q * d[..., None]
    elif qtype in ("Q4_K", "Q5_K"):
        scale = d.repeat_interleave(SUPER // GROUP, dim=1) * planes.sc.float()
        low = planes.dmin.float().repeat_interleave(SUPER // GROUP, dim=1) * planes.m.float()
        w = scale[..., None] * q - low[..., None]
    else:  # Q6_K: a scale per 16 values
        scale = d.repeat_interleave(SUPER // 16, dim=1) * planes.sc.float()
        w = scale[..., None] * (q.reshape(n, -1, 16) - 32)
    return w.reshape(n, -1)


def gguf_mm_ref(x: torch.Tensor, planes: GgufPlanes) -> torch.Tensor:
    """x [M, K] times the weight^T, in float32: the kernels' reference."""
    return x.float() @ dequantize_planes(planes).t()
