"""Weight-only int4 / int8 GEMMs in Triton (W4A16, W8A16): out [M, N] = x [M, K] times a
weight kept in tllm.kernels.woq's packed form (qweight int32 [N, K / pack], scales and zeros
[K / group, N]), dequantized in registers.

Values are unpacked without an int-to-float conversion (a slow instruction): the layout
interleaves each chunk of K so that one bit-field of a row of words is a contiguous run of
K; a field is masked and OR-ed into a float's exponent (2^23 in fp32; 128 in bf16, 1024 in
fp16 for the GEMV's packed math), which reads as bias + q, and one multiply-add takes it to
q - z exactly. A group's scale multiplies a whole chunk's partial sum.

Kernels, by the number of rows M (WoqConfig.kind; `default_config` picks):
- "gemv" (M = 1, batch-1 decode; w4a16_gemv.py): CUDA cores, packed 16-bit math.
- "wx" (2 <= M < DEQUANT_MIN_ROWS; w4a16_mm.py): the dequantized weight tile is the MMA's
  left operand, x^T its narrow right one (BLOCK_M 16 .. 128), split-K to fill the SMs.
- "xw" (`_mm_kernel` below, the first dot kernel): x the left operand, the weight tile the
  right one; kept for comparison in the benchmark's sweep and for any shape it wins.
- "dequant" (M >= DEQUANT_MIN_ROWS, prefill): the weight dequantized once into a [N, K]
  buffer (`_dequant_kernel`) and multiplied by cuBLAS, as vLLM does for AWQ.
Split-K partials are added in a fixed split order (deterministic): by the last split of a
tile to arrive ("gemv", "wx"), or by a second kernel ("xw").

The first H200 run (2026-12-01, benchmarks/gpu_int4.py) measured the first GEMV at 1-1.5 TB/s
and the "xw" kernel at 0.3x bf16 at M = 64; the defaults below follow the instruction-count
analysis in w4a16_gemv.py and w4a16_mm.py (SASS for sm_90 compiled on the CPU) until the
benchmark's sweep over `sweep_configs` has measured them on the device.

Reference: tllm.kernels.woq.woq_mm_ref / dequantize."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tllm.kernels.triton.fp8_gemm import _sum_splits_kernel
from tllm.kernels.triton.launch import cdiv, dot_precision, needs_fp32_dot, next_pow2, num_sms
from tllm.kernels.triton.w4a16_gemv import _field_minus_zero, _gemv_kernel, split_counters
from tllm.kernels.triton.w4a16_mm import _mm_wx_kernel
from tllm.kernels.woq import WoqLayout

# From here a dequantized weight and cuBLAS: at M = 256 on the H200 it was 1.3-1.9x faster
# than the 128 x 128 tiles (2026-12-02 sweep); the tiles grow ~linearly from M = 64.
DEQUANT_MIN_ROWS = 128
_MIN_TILES_PER_SPLIT = 2   # K tiles a split at least: shorter ones cost more than they gain
KINDS = ("gemv", "wx", "xw", "dequant")
PACKED_GEMV = True         # the GEMV's packed 16-bit math (switches for the benchmark's check)
PACKED_DOT = True          # the wx kernel's paired 16-bit dequantization


@dataclass(frozen=True)
class WoqConfig:
    """Launch shape. kind "gemv" (block_m 1): block_n rows a program, `chunks` interleave
    chunks of K an iteration, `packed` 16-bit math (4-bit weights, bf16/fp16 x, groups of
    whole chunks; else fp32). "wx" / "xw": block_m x block_n output tiles, one chunk of K an
    iteration. split_k: K splits (1 = none). "dequant": the rest is ignored."""
    block_m: int
    block_n: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    kind: str = ""             # "" = "gemv" for block_m 1, else "wx"
    chunks: int = 1
    packed: bool = True

    @property
    def resolved_kind(self) -> str:
        return self.kind or ("gemv" if self.block_m == 1 else "wx")

    def label(self) -> str:
        kind = self.resolved_kind
        if kind == "dequant":
            return "dequant+cuBLAS"
        if kind == "gemv":
            return (f"gemv bn{self.block_n} ch{self.chunks} w{self.num_warps} "
                    f"split{self.split_k}{' packed' if self.packed else ' fp32'}")
        return (f"{kind} bm{self.block_m} bn{self.block_n} w{self.num_warps} "
                f"st{self.num_stages} split{self.split_k}")


@triton.jit
def _mm_kernel(out_ptr, part_ptr, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, tiles_per_split,
               num_tiles, stride_xm, stride_om, stride_qn, stride_sg, stride_ps, stride_pm,
               BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, KW: tl.constexpr, GROUP_M: tl.constexpr,
               IS_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Program (m, n tile in grouped order; k split): each field of a K tile is a
    [KW, BLOCK_N] operand of (q - z) in the activation dtype (exact: small integers) for
    one tl.dot with the matching KW columns of x; the tile's product is scaled by its
    group's scales (or each field by its own, when a group is shorter than the tile)."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = KW * PACK
    HI: tl.constexpr = 23 // BITS
    TILE_SCALED: tl.constexpr = GROUP % BLOCK_K == 0
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = (offs_m % M).to(tl.int64)     # padding rows re-read real ones: no mask
    rows_n = offs_n % N
    offs_w = tl.arange(0, KW)
    x_base = x_ptr + rows_m[:, None] * stride_xm + offs_w[None, :]
    w_ptrs = qw_ptr + rows_n.to(tl.int64)[:, None] * stride_qn + offs_w[None, :]
    t_lo = pid_k * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, num_tiles)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        k0 = t * BLOCK_K
        words = tl.load(w_ptrs + t * KW)
        high = words >> (HI * BITS)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(PACK):
            g = (k0 + j * KW) // GROUP
            if TILE_SCALED:
                g = k0 // GROUP
            z = tl.load(z_ptr + g * stride_sg + rows_n).to(tl.float32)
            qz = _field_minus_zero(words, high, z[:, None], j, BITS)
            if not TILE_SCALED:
                qz = qz * tl.load(s_ptr + g * stride_sg + rows_n).to(tl.float32)[:, None]
            xj = tl.load(x_base + k0 + j * KW)
            if DOT_FP32:
                xj = xj.to(tl.float32)
            part = tl.dot(xj, tl.trans(qz.to(xj.dtype)), part, input_precision=PRECISION)
        if TILE_SCALED:
            part = part * tl.load(s_ptr + (k0 // GROUP) * stride_sg + rows_n).to(
                tl.float32)[None, :]
        acc += part
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :],
                 acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, qw_ptr, s_ptr, z_ptr, N, stride_wn, stride_qn, stride_sg,
                    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    KW: tl.constexpr):
    """One K tile (chunk) of BLOCK_N rows of the dequantized weight w [N, K] in w's dtype:
    ((q - z) * s) rounded once."""
    PACK: tl.constexpr = 32 // BITS
    HI: tl.constexpr = 23 // BITS
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    k0 = t * KW * PACK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N
    offs_w = tl.arange(0, KW)
    words = tl.load(qw_ptr + rows.to(tl.int64)[:, None] * stride_qn + t * KW + offs_w[None, :])
    high = words >> (HI * BITS)
    out_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_w[None, :]
    for j in tl.static_range(PACK):
        g = (k0 + j * KW) // GROUP
        z = tl.load(z_ptr + g * stride_sg + rows).to(tl.float32)
        s = tl.load(s_ptr + g * stride_sg + rows).to(tl.float32)
        w = _field_minus_zero(words, high, z[:, None], j, BITS) * s[:, None]
        tl.store(out_ptrs + k0 + j * KW, w.to(w_ptr.dtype.element_ty),
                 mask=(offs_n < N)[:, None])


# ---- configurations ----

def default_config(m: int, n: int, k: int, layout: WoqLayout,
                   device: torch.device) -> WoqConfig:
    """The launch for an [m, k] x [k, n] product (see the module docstring for the kinds).
    M = 1: 8 (or 16) rows a program, every thread on a different 16 bytes of K and all the
    rows in its registers (one x value serves 8 or 16 weights), ~2.8 SASS instructions a
    weight in the packed math; the H200 sweep of 2026-12-02 chose 16 rows, 8 chunks, 2 warps
    where that still leaves 2 programs an SM (qkv, gate_up: 12-13% faster than 8 rows and 32
    chunks) and 8 rows, 16 chunks, 4 warps otherwise (o, down). Small M: one 16..64-row x^T
    tile against 128 weight rows (3.9 instructions a weight at 16 rows, 4.8 with 64), 8 warps
    up to 16 rows (the sweep: 5-9% faster), K split until the SMs are full twice over.
    Larger M: 128 x 128 tiles; from DEQUANT_MIN_ROWS, dequantize + cuBLAS."""
    sms = num_sms(device)
    if m >= DEQUANT_MIN_ROWS:
        return WoqConfig(0, 0, kind="dequant")
    if m == 1:
        return _gemv_default(n, k, layout, sms)
    if layout.chunk_words < 16:       # the dot kernels need 16-deep fields
        return WoqConfig(0, 0, kind="dequant")
    if m <= 64:
        cfg = WoqConfig(max(16, next_pow2(m)), 128, num_warps=8 if m <= 16 else 4,
                        num_stages=3, kind="wx")
        return _with_split(cfg, n, k, layout, sms)
    return _with_split(WoqConfig(128, 128, num_warps=8, num_stages=3, kind="wx"), n, k,
                       layout, sms, tiles_m=cdiv(m, 128))


def _gemv_default(n: int, k: int, layout: WoqLayout, sms: int) -> WoqConfig:
    """16 rows a program where that leaves 2 programs an SM, else 8; a narrow layer (fewer
    than 2 programs an SM at 8 rows) splits K, with shorter iterations where K holds too few
    chunks for the splits."""
    if cdiv(n, 16) >= 2 * sms:
        return WoqConfig(1, 16, 1, num_warps=2, num_stages=1, kind="gemv",
                         chunks=_gemv_chunks(k, layout, 8))
    tiles = cdiv(n, 8)
    want = cdiv(2 * sms, tiles) if tiles < 2 * sms else 1
    total = k // layout.chunk
    chunks = _gemv_chunks(k, layout, max(1, min(16, total // want)))
    split = max(1, min(want, total // chunks))
    return WoqConfig(1, 8, split, num_warps=4, num_stages=1, kind="gemv", chunks=chunks)


def _gemv_chunks(k: int, layout: WoqLayout, most: int) -> int:
    """The largest power of two <= most whose chunks divide K."""
    chunks = next_pow2(most + 1) // 2
    while chunks > 1 and (k // layout.chunk) % chunks:
        chunks //= 2
    return chunks


def _with_split(cfg: WoqConfig, n: int, k: int, layout: WoqLayout, sms: int,
                tiles_m: int = 1) -> WoqConfig:
    tiles = cdiv(n, cfg.block_n) * tiles_m
    if tiles >= 2 * sms:
        return cfg
    iters = k // (layout.chunk * cfg.chunks)
    split = max(1, min(cdiv(2 * sms, tiles), iters // _MIN_TILES_PER_SPLIT))
    return replace(cfg, split_k=split)


def usable(cfg: WoqConfig, m: int, n: int, k: int, layout: WoqLayout,
           device: torch.device) -> WoqConfig:
    """cfg made runnable for this product: gemv chunks that divide K, split_k 0 resolved
    to the default fill of the SMs; ValueError for a kind that cannot take it."""
    kind = cfg.resolved_kind
    if kind not in KINDS:
        raise ValueError(f"woq GEMM: config kind {cfg.kind!r} is not one of {KINDS}")
    if kind == "gemv" and m != 1:
        raise ValueError("the GEMV config (block_m 1) takes one row")
    if kind in ("wx", "xw") and layout.chunk_words < 16:
        raise ValueError("the dot kernel needs chunks of 16 words")
    cfg = replace(cfg, kind=kind, chunks=_gemv_chunks(k, layout, cfg.chunks)
                  if kind == "gemv" else 1)
    if cfg.split_k == 0 and kind != "dequant":
        tiles_m = 1 if kind == "gemv" else cdiv(m, cfg.block_m)
        cfg = _with_split(replace(cfg, split_k=1), n, k, layout, num_sms(device), tiles_m)
    return cfg


def sweep_configs(m: int) -> list[WoqConfig]:
    """The launches benchmarks/gpu_int4.py times for an M bucket (1, <= 16, <= 64, more);
    the first is the default's kind and tiles. split_k 0: the default split for the shape."""
    if m == 1:
        gemv = [(8, 32, 4, 0, True), (4, 32, 4, 0, True), (16, 16, 4, 0, True),
                (8, 16, 4, 0, True), (16, 16, 8, 0, True), (8, 32, 4, 2, True),
                (16, 8, 2, 0, True), (8, 32, 4, 0, False)]
        return [WoqConfig(1, bn, split, num_warps=w, num_stages=1, kind="gemv", chunks=ch,
                          packed=packed) for bn, ch, w, split, packed in gemv]
    if m <= 16:
        dots = [("wx", 16, 128, 4, 3, 0), ("wx", 16, 64, 4, 3, 0), ("wx", 16, 128, 4, 4, 0),
                ("wx", 16, 128, 4, 3, 1), ("wx", 16, 128, 8, 3, 0), ("xw", 16, 64, 4, 4, 0)]
    elif m <= 64:
        dots = [("wx", 64, 128, 4, 3, 0), ("wx", 64, 64, 4, 3, 0), ("wx", 64, 128, 4, 4, 0),
                ("wx", 32, 128, 4, 3, 0), ("wx", 64, 128, 8, 3, 0), ("xw", 64, 64, 4, 4, 0)]
    else:
        dots = [("wx", 128, 128, 8, 3, 0), ("wx", 64, 128, 4, 3, 0), ("wx", 64, 128, 4, 4, 0),
                ("wx", 128, 64, 4, 3, 0), ("xw", 128, 128, 8, 3, 0)]
    configs = [WoqConfig(bm, bn, split, num_warps=w, num_stages=st, kind=kind)
               for kind, bm, bn, w, st, split in dots]
    return configs + ([WoqConfig(0, 0, kind="dequant")] if m > 64 else [])


# ---- wrappers ----

def woq_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           layout: WoqLayout, config: WoqConfig | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, rows contiguous) times the packed weight -> [M, N] in x's
    dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    _check(x, qweight, scales, zeros, layout)
    cfg = usable(config or default_config(m, n, k, layout, x.device), m, n, k, layout,
                 x.device)
    if cfg.kind == "dequant":
        return F.linear(x, woq_dequantize(qweight, scales, zeros, layout, x.dtype))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if cfg.kind == "gemv":
        _launch_gemv(out, x, qweight, scales, zeros, layout, cfg)
    elif cfg.kind == "wx":
        _launch_wx(out, x, qweight, scales, zeros, layout, cfg)
    else:
        _launch_xw(out, x, qweight, scales, zeros, layout, cfg)
    return out


def _splits(num_tiles: int, split_k: int) -> tuple[int, int]:
    per_split = cdiv(num_tiles, max(1, split_k))
    return per_split, cdiv(num_tiles, per_split)


def _launch_gemv(out, x, qweight, scales, zeros, layout: WoqLayout, cfg: WoqConfig) -> None:
    n, k = out.shape[1], x.shape[1]
    num_tiles = k // (layout.chunk * cfg.chunks)
    per_split, splits = _splits(num_tiles, cfg.split_k)
    tiles_n = cdiv(n, cfg.block_n)
    part = torch.empty(splits, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    packed = (cfg.packed and PACKED_GEMV and layout.bits == 4 and x.dtype in (torch.bfloat16, torch.float16)
              and layout.group % layout.chunk == 0 and not _interpreted(_gemv_kernel))
    _gemv_kernel[(tiles_n, splits)](
        out, part, split_counters(x.device, tiles_n), x, qweight, scales, zeros, n,
        per_split, num_tiles, qweight.stride(0), scales.stride(0), BITS=layout.bits,
        GROUP=layout.group, BLOCK_N=cfg.block_n, KW=layout.chunk_words, CHUNKS=cfg.chunks,
        IS_SPLIT=splits > 1, PACKED=packed, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_wx(out, x, qweight, scales, zeros, layout: WoqLayout, cfg: WoqConfig) -> None:
    m, n, k = out.shape[0], out.shape[1], x.shape[1]
    num_tiles = k // layout.chunk
    per_split, splits = _splits(num_tiles, cfg.split_k)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    pairs = (cfg.packed and PACKED_DOT and layout.bits == 4 and layout.group % layout.chunk == 0
             and x.dtype in (torch.bfloat16, torch.float16))
    part = (torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1
            else out)
    _mm_wx_kernel[(tiles, splits)](
        out, part, split_counters(x.device, tiles), x, qweight, scales, zeros, m, n,
        per_split, num_tiles, x.stride(0), qweight.stride(0), scales.stride(0), m * n,
        BITS=layout.bits, GROUP=layout.group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        KW=layout.chunk_words, IS_SPLIT=splits > 1, DOT_FP32=needs_fp32_dot(_mm_wx_kernel, x.dtype),
        PRECISION=dot_precision(x.dtype), PAIRS=pairs, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def _launch_xw(out, x, qweight, scales, zeros, layout: WoqLayout, cfg: WoqConfig) -> None:
    m, n, k = out.shape[0], out.shape[1], x.shape[1]
    num_tiles = k // layout.chunk
    per_split, splits = _splits(num_tiles, cfg.split_k)
    part = (torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1
            else out)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), splits)
    _mm_kernel[grid](
        out, part, x, qweight, scales, zeros, m, n, per_split, num_tiles, x.stride(0),
        out.stride(0), qweight.stride(0), scales.stride(0),
        part.stride(0) if splits > 1 else 0, part.stride(1) if splits > 1 else 0,
        BITS=layout.bits, GROUP=layout.group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        KW=layout.chunk_words, GROUP_M=cfg.group_m, IS_SPLIT=splits > 1,
        DOT_FP32=needs_fp32_dot(_mm_kernel, x.dtype), PRECISION=dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        block_cols = min(1024, next_pow2(n))
        _sum_splits_kernel[(m, cdiv(n, block_cols))](
            out, part, n, splits, out.stride(0), part.stride(0), part.stride(1),
            BLOCK=block_cols, num_warps=4)


def _interpreted(kernel) -> bool:
    """The Triton interpreter runs no inline PTX: the GEMV takes its fp32 math there."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(kernel, InterpretedFunction)


def woq_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   layout: WoqLayout, dtype: torch.dtype) -> torch.Tensor:
    """The packed weight -> [N, K] in `dtype` (((q - z) * s) rounded once)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * layout.pack
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    _dequant_kernel[(cdiv(n, 64), k // layout.chunk)](
        w, qweight, scales, zeros, n, w.stride(0), qweight.stride(0), scales.stride(0),
        BITS=layout.bits, GROUP=layout.group, BLOCK_N=64, KW=layout.chunk_words, num_warps=4)
    return w


def _check(x, qweight, scales, zeros, layout: WoqLayout) -> None:
    m, k = x.shape
    if qweight.dtype != torch.int32 or qweight.shape[1] * layout.pack != k:
        raise ValueError(f"woq GEMM: x {tuple(x.shape)} and qweight {tuple(qweight.shape)} "
                         f"({qweight.dtype}) do not multiply at {layout.bits} bits")
    if k % layout.group or layout.group % 16 or k % layout.chunk:
        raise ValueError(f"woq GEMM: group {layout.group} must be a multiple of 16 dividing "
                         f"K = {k}, and K a multiple of the chunk ({layout.chunk})")
    groups = (k // layout.group, qweight.shape[0])
    if tuple(scales.shape) != groups or tuple(zeros.shape) != groups:
        raise ValueError(f"woq GEMM: scales {tuple(scales.shape)} / zeros "
                         f"{tuple(zeros.shape)}, expected {groups}")
    if x.stride(-1) != 1 or qweight.stride(-1) != 1 or scales.stride() != zeros.stride():
        raise ValueError("woq GEMM: x and the weight need contiguous rows, scales and zeros "
                         "the same strides")
