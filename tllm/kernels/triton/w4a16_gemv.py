"""The M = 1 weight-only GEMV (batch-1 decode) and the split-K fix-up shared with the dot
kernels of w4a16_gemm. Layout and values: tllm.kernels.woq (qweight int32 [N, K / pack],
interleaved chunks; scales / zeros [K / group, N]).

Batch-1 decode reads every weight once and does two multiply-adds with it, so the GEMV is
bound by instruction issue as much as by memory: at 3.2 TB/s an H200 meets 6.4 G int4
weights a millisecond, while its 132 SMs issue ~33 G thread-instructions a millisecond. The
first version took ~5.2 SASS instructions a weight (fp32 math; x broadcast through shared
memory) and reached 1-1.5 TB/s. Two things here:
- MATH "fp32": per weight one LOP3 (the field OR-ed into 2^23), one FFMA (q - z) and one FFMA
  (times x); x is loaded straight into the tile's column layout; each thread holds several
  rows of the same columns, so one x value serves them all.
- MATH "packed" (4-bit weights, bf16/fp16 activations, GPU): a word's eight fields go out in
  four pairs (fields j, j + 4 sit 16 bits apart: one LOP3 makes a bf16x2 / f16x2 pair of
  128 + q, resp. 1024 + q), subtracted and multiplied by x in packed HFMA2 (two weights an
  instruction), four products summed in 16-bit, then added in fp32: 2.25 instructions a
  weight in the PTX, 2.8 in the whole loop (sm_90 SASS of the default launch, compiled on
  the CPU; the fp32 math: 4.9). Written as inline PTX; the Triton interpreter has none, so
  there it runs the fp32 math over the same tiles (the tiling and indexing are what the CPU
  tests check). The 16-bit partial sums cost precision: ~3e-3 relative error in bf16.
Each program streams BLOCK_N rows along K, CHUNKS interleave chunks (CHUNKS * 64 bytes of
every row) an iteration, the next tile's words loaded before this one's math (two tiles in
flight a program). Split-K programs write fp32 partials; the last of an output tile's splits
to arrive (an atomic counter) adds them in split order and stores the output, so there is
no second launch and the sum is deterministic."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_counters: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []   # outgrown counter buffers: a captured CUDA graph may hold one


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 zeros, one per output tile of a split-K launch; each launch leaves them zero
    (its last program resets its tile's). Kept per device: launches on one stream are
    ordered, and the kernels of one model run on one stream. Default launches split only
    narrow products (fewer tiles than 2 an SM), so the first buffer is never outgrown."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < tiles:
        if buf is not None:
            _retired.append(buf)
        buf = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


@triton.jit
def _field_minus_zero(words, high, z, J: tl.constexpr, BITS: tl.constexpr):
    """Bit-field J of a tile of words minus the zero points z (broadcast to the tile):
    float32 q - z, exactly. A field inside the 23-bit mantissa is masked in place, others
    from `high` (words >> HI * BITS); the masked bits OR-ed into 2^23 read as
    2^23 + q * UNIT, so one fused multiply-add by 1 / UNIT (a power of two) leaves q - z."""
    HI: tl.constexpr = 23 // BITS
    POS: tl.constexpr = J if J < HI else J - HI
    FIELD: tl.constexpr = ((1 << BITS) - 1) << (BITS * POS)
    INV_UNIT: tl.constexpr = 1.0 / (1 << (BITS * POS))
    src = words if J < HI else high
    biased = ((src & FIELD) | 0x4B000000).to(tl.float32, bitcast=True)
    return biased * INV_UNIT - (8388608.0 * INV_UNIT + z)


# One word (eight 4-bit fields, field j meeting x_j) times its x: $0 = sum_j (q_j - z) * x_j
# (fp32 bits). $1 the word, $2 the pair (-(B + z), -(B + z)) in the 16-bit type, $3..$6 the
# pairs (x_j, x_j+4) for j = 0..3. Pair j: ((word >> 4j) & 0x000F000F)
# | BIAS reads as (B + q_j, B + q_j+4); B = 128 (bf16) or 1024 (fp16), exact with unit 1.
_PAIR_ASM = """{{
.reg .b32 t, v, d, a, one, zero, lo, hi;
mov.b32 one, {one};
mov.b32 zero, 0;
lop3.b32 v, $1, 0x000F000F, {bias}, 0xEA;
fma.rn.{t}x2 d, v, one, $2;
fma.rn.{t}x2 a, d, $3, zero;
shr.u32 t, $1, 4;
lop3.b32 v, t, 0x000F000F, {bias}, 0xEA;
fma.rn.{t}x2 d, v, one, $2;
fma.rn.{t}x2 a, d, $4, a;
shr.u32 t, $1, 8;
lop3.b32 v, t, 0x000F000F, {bias}, 0xEA;
fma.rn.{t}x2 d, v, one, $2;
fma.rn.{t}x2 a, d, $5, a;
shr.u32 t, $1, 12;
lop3.b32 v, t, 0x000F000F, {bias}, 0xEA;
fma.rn.{t}x2 d, v, one, $2;
fma.rn.{t}x2 a, d, $6, a;
{unpack}
add.f32 $0, lo, hi;
}}"""
_UNPACK_BF16 = "shl.b32 lo, a, 16;\nand.b32 hi, a, 0xFFFF0000;"
_UNPACK_F16 = (".reg .b16 l16, h16;\nmov.b32 {l16, h16}, a;\ncvt.f32.f16 lo, l16;\n"
               "cvt.f32.f16 hi, h16;")
PAIR_ASM_BF16: tl.constexpr = tl.constexpr(_PAIR_ASM.format(
    t="bf16", one="0x3F803F80", bias="0x43004300", unpack=_UNPACK_BF16))
PAIR_ASM_F16: tl.constexpr = tl.constexpr(_PAIR_ASM.format(
    t="f16", one="0x3C003C00", bias="0x64006400", unpack=_UNPACK_F16))


@triton.jit
def _bits16(v):
    """16-bit float values -> their bits, zero-extended to int32."""
    return v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _x_pair(x_ptr, x_offs, J: tl.constexpr, KW: tl.constexpr):
    """The 16-bit x values of fields J and J + 4 of each column, packed (low, high)."""
    lo = _bits16(tl.load(x_ptr + x_offs + J * KW))
    hi = _bits16(tl.load(x_ptr + x_offs + (J + 4) * KW))
    return lo | (hi << 16)


@triton.jit
def _packed_word_dot(words, z, x_ptr, x_offs, KW: tl.constexpr, IS_BF16: tl.constexpr):
    """The eight products of each word (4-bit fields) with its x values, summed (fp32),
    through the packed 16-bit PTX above; x_offs [1, C, KW] locates field 0 of each column."""
    if IS_BF16:
        nz = _bits16((-(z + 128.0)).to(tl.bfloat16))
    else:
        nz = _bits16((-(z + 1024.0)).to(tl.float16))
    nz = nz | (nz << 16)
    x0 = _x_pair(x_ptr, x_offs, 0, KW)
    x1 = _x_pair(x_ptr, x_offs, 1, KW)
    x2 = _x_pair(x_ptr, x_offs, 2, KW)
    x3 = _x_pair(x_ptr, x_offs, 3, KW)
    out = tl.inline_asm_elementwise(
        PAIR_ASM_BF16 if IS_BF16 else PAIR_ASM_F16, "=r,r,r,r,r,r,r",
        [words, nz, x0, x1, x2, x3], dtype=tl.int32, is_pure=True, pack=1)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _fp32_word_dot(words, z, s, x_ptr, x_offs, acc, k_col, BITS: tl.constexpr,
                   KW: tl.constexpr, GROUP: tl.constexpr, CHUNK_SCALED: tl.constexpr,
                   s_ptr, z_ptr, rows, stride_sg):
    """acc + sum_j (q_j - z) * x_j [* s_j]: fp32 math, one field at a time. Where a group is
    shorter than a chunk (not CHUNK_SCALED) each field loads its own zero and scale."""
    PACK: tl.constexpr = 32 // BITS
    HI: tl.constexpr = 23 // BITS
    high = words >> (HI * BITS)
    for j in tl.static_range(PACK):
        xj = tl.load(x_ptr + x_offs + j * KW).to(tl.float32)
        if CHUNK_SCALED:
            acc += _field_minus_zero(words, high, z, j, BITS) * xj
        else:
            g = (k_col + j * KW) // GROUP
            zj = tl.load(z_ptr + g * stride_sg + rows).to(tl.float32)
            sj = tl.load(s_ptr + g * stride_sg + rows).to(tl.float32)
            acc += _field_minus_zero(words, high, zj, j, BITS) * xj * sj
    return acc


@triton.jit
def _gemv_kernel(out_ptr, part_ptr, count_ptr, x_ptr, qw_ptr, s_ptr, z_ptr, N,
                 tiles_per_split, num_tiles, stride_qn, stride_sg,
                 BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                 KW: tl.constexpr, CHUNKS: tl.constexpr, IS_SPLIT: tl.constexpr,
                 PACKED: tl.constexpr):
    """Program (n tile, k split): BLOCK_N rows over its K tiles of CHUNKS chunks; the tile is
    [BLOCK_N, CHUNKS, KW] words, field j of word (c, w) meeting x[k0 + c * CHUNK + j*KW + w]."""
    PACK: tl.constexpr = 32 // BITS
    CHUNK: tl.constexpr = KW * PACK
    CHUNK_SCALED: tl.constexpr = GROUP % CHUNK == 0       # one zero and scale a chunk
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N)[:, None, None]                # rows past N are computed, not stored
    cols_c = tl.arange(0, CHUNKS)[None, :, None]
    cols_w = tl.arange(0, KW)[None, None, :]
    w_ptrs = qw_ptr + rows.to(tl.int64) * stride_qn + cols_c * KW + cols_w
    x_offs = cols_c * CHUNK + cols_w
    t_lo = pid_k * tiles_per_split
    t_hi = tl.minimum(t_lo + tiles_per_split, num_tiles)
    acc = tl.zeros([BLOCK_N, CHUNKS, KW], dtype=tl.float32)
    words = tl.load(w_ptrs + t_lo * (CHUNKS * KW), eviction_policy="evict_first")
    for t in range(t_lo, t_hi):
        k0 = t * (CHUNKS * CHUNK)
        # the next tile's words are in flight while this one is multiplied; the last
        # iteration reloads its own tile (an L1 hit: cheaper than a masked load's zeroing)
        t_next = tl.minimum(t + 1, t_hi - 1)
        nxt = tl.load(w_ptrs + t_next * (CHUNKS * KW), eviction_policy="evict_first")
        g = (k0 + cols_c * CHUNK) // GROUP                # [1, CHUNKS, 1]
        z = tl.load(z_ptr + g * stride_sg + rows).to(tl.float32)
        s = tl.load(s_ptr + g * stride_sg + rows).to(tl.float32)
        if PACKED:
            inner = _packed_word_dot(words, z, x_ptr + k0, x_offs, KW,
                                     x_ptr.dtype.element_ty == tl.bfloat16)
        else:
            inner = tl.zeros([BLOCK_N, CHUNKS, KW], dtype=tl.float32)
            inner = _fp32_word_dot(words, z, s, x_ptr + k0, x_offs, inner,
                                   k0 + cols_c * CHUNK, BITS, KW, GROUP, CHUNK_SCALED,
                                   s_ptr, z_ptr, rows, stride_sg)
        if CHUNK_SCALED:
            acc += inner * s
        else:
            acc += inner
        words = nxt
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    split_store(out_ptr, part_ptr, count_ptr, out, offs_n, offs_n < N, pid_n, pid_k,
                N, tl.num_programs(1), IS_SPLIT)


@triton.jit
def split_store(out_ptr, part_ptr, count_ptr, val, offs, mask, tile, pid_k, part_stride,
                splits, IS_SPLIT: tl.constexpr):
    """Store an fp32 tile `val` (at element offsets `offs` of out) directly, or as split
    pid_k's partial: part[pid_k * part_stride + offs]; the last of the `splits` splits of
    `tile` to arrive sums the partials in split order into out and resets the counter."""
    if not IS_SPLIT:
        tl.store(out_ptr + offs, val.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k * part_stride + offs, val, mask=mask)
        tl.debug_barrier()              # every thread's partial is written before the count
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == splits - 1:
            total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for k in range(1, splits):
                total += tl.load(part_ptr + k * part_stride + offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)
