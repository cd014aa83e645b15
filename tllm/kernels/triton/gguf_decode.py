"""Decoding GGUF planes (tllm.kernels.gguf) in registers: the pieces every GGUF kernel of
tllm.kernels.triton.gguf_gemm shares. QTYPE is a constexpr: the index of the type in
KERNEL_TYPES (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).

A weight value is w = scale * q + low, q the stored integer less the type's offset (Q4_0 8,
Q5_0 16, Q8_0 none, Q6_K 32; the others 0), with one scale and low a half-group (16 values:
the low nibbles of a group's 16 bytes are values 0-15, the high nibbles 16-31); low is 0 but
for Q4_1 / Q5_1 (m) and Q4_K / Q5_K (-dmin * m). Keeping q apart from its scales lets a GEMV
sum q * x over a half-group first and scale once per half-group (the sum of x times low once
per group), as llama.cpp does: a float32 FMA a value, and a tiny accumulator.

Index tensors broadcast: rows r, groups g and positions j (0-15 within a half) may be any
shapes that broadcast together (a GEMV's [BN, 1, 1], [1, BG, 1], [1, 1, 16]; a tensor-core
tile's [1, BN], a scalar group and [16, 1]); scales come back in the shape of r and g."""
from __future__ import annotations

import triton
import triton.language as tl

_MAGIC = tl.constexpr(0x4B000000)  # the bits of 2^23 as float32


@triton.jit
def as_float(q, offset: tl.constexpr):
    """float32(q - offset) for 0 <= q < 2^22 (int32): q is placed in the mantissa of 2^23
    (an OR and a subtraction; an int-to-float conversion runs at a quarter of the rate)."""
    return (q | _MAGIC).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def values(qs_ptr, qh_ptr, r, g, jb, jt, mask, s_qs, s_qh, QTYPE: tl.constexpr):
    """float32 (q - offset) of values 32g + j and 32g + 16 + j of rows r (int64); for the
    4-bit types (Q4_0, Q4_1, Q4_K) the high half is 16 (q - offset), its nibble decoded where
    it lies (one AND-OR, no shift: `scales` gives that half a scale / 16, exact). One return
    at the end: the compiler visits code after a return inside a constexpr branch.
    Positions j = jb + jt: jt the positions a thread holds (an arange: its shifts become
    constants), jb what varies between threads (or 0)."""
    j = jb + jt
    if QTYPE == 4:  # Q8_0: int8 values, shifted to 0..255 for as_float
        base = qs_ptr + r * s_qs + g * 32 + j
        lo = tl.load(base, mask=mask, other=0).to(tl.int32) + 128
        hi = tl.load(base + 16, mask=mask, other=0).to(tl.int32) + 128
    else:
        byte = tl.load(qs_ptr + r * s_qs + g * 16 + j, mask=mask, other=0).to(tl.int32)
        lo = byte & 15
        if QTYPE == 0 or QTYPE == 1 or QTYPE == 5:  # 4-bit: the high nibble left in place
            hi = byte & 0xF0
        else:
            hi = byte >> 4
        if QTYPE == 2 or QTYPE == 3 or QTYPE == 6:  # Q5_0, Q5_1, Q5_K: bit j of the word
            h = tl.load(qh_ptr + r * s_qh + g, mask=mask, other=0) >> jb
            lo = lo | (((h >> jt) & 1) << 4)
            hi = hi | (((h >> (jt + 16)) & 1) << 4)
        if QTYPE == 7:  # Q6_K: 2 bits each, values 0-15 in one word, 16-31 in the next
            h_lo = tl.load(qh_ptr + r * s_qh + 2 * g, mask=mask, other=0) >> (2 * jb)
            h_hi = tl.load(qh_ptr + r * s_qh + 2 * g + 1, mask=mask, other=0) >> (2 * jb)
            lo = lo | (((h_lo >> (2 * jt)) & 3) << 4)
            hi = hi | (((h_hi >> (2 * jt)) & 3) << 4)
    if QTYPE == 0:
        q_lo, q_hi = as_float(lo, 8), as_float(hi, 128)
    elif QTYPE == 2:
        q_lo, q_hi = as_float(lo, 16), as_float(hi, 16)
    elif QTYPE == 4:
        q_lo, q_hi = as_float(lo, 128), as_float(hi, 128)
    elif QTYPE == 7:
        q_lo, q_hi = as_float(lo, 32), as_float(hi, 32)
    else:
        q_lo, q_hi = as_float(lo, 0), as_float(hi, 0)
    return q_lo, q_hi


@triton.jit
def scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, mask, s_d, s_dmin, s_sc, s_m,
           QTYPE: tl.constexpr):
    """(scale of the low half, scale of the high half, low) of groups g of rows r: w = scale
    * (q - offset) + low. The halves' scales differ for Q6_K, and by the 16 of `values` for
    the 4-bit types; low is zeros (unused, so
    compiled away) where the type has none."""
    if QTYPE == 5 or QTYPE == 6:  # Q4_K, Q5_K: (d * sc) * q - dmin * m per 32
        d = tl.load(d_ptr + r * s_d + g // 8, mask=mask, other=0).to(tl.float32)
        dmin = tl.load(dmin_ptr + r * s_dmin + g // 8, mask=mask, other=0).to(tl.float32)
        s_lo = d * tl.load(sc_ptr + r * s_sc + g, mask=mask, other=0).to(tl.float32)
        if QTYPE == 5:
            s_hi = s_lo * 0.0625
        else:
            s_hi = s_lo
        low = -(dmin * tl.load(m_ptr + r * s_m + g, mask=mask, other=0).to(tl.float32))
    elif QTYPE == 7:  # Q6_K: (d * sc) * (q - 32) per 16
        d = tl.load(d_ptr + r * s_d + g // 8, mask=mask, other=0).to(tl.float32)
        s_lo = d * tl.load(sc_ptr + r * s_sc + 2 * g, mask=mask, other=0).to(tl.float32)
        s_hi = d * tl.load(sc_ptr + r * s_sc + 2 * g + 1, mask=mask, other=0).to(tl.float32)
        low = tl.zeros_like(s_lo)
    else:
        s_lo = tl.load(d_ptr + r * s_d + g, mask=mask, other=0).to(tl.float32)
        if QTYPE == 0 or QTYPE == 1:
            s_hi = s_lo * 0.0625
        else:
            s_hi = s_lo
        if QTYPE == 1 or QTYPE == 3:  # Q4_1, Q5_1: d * q + m
            low = tl.load(m_ptr + r * s_m + g, mask=mask, other=0).to(tl.float32)
        else:  # Q4_0, Q5_0, Q8_0: d * (q - offset)
            low = tl.zeros_like(s_lo)
    return s_lo, s_hi, low


@triton.jit
def dequant_halves(qs_ptr, qh_ptr, d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, j, mask,
                   s_qs, s_qh, s_d, s_dmin, s_sc, s_m, QTYPE: tl.constexpr):
    """float32 weights (values 32g + j, values 32g + 16 + j), as gguf's dequantize computes
    them (j: positions every thread holds alike)."""
    q_lo, q_hi = values(qs_ptr, qh_ptr, r, g, 0, j, mask, s_qs, s_qh, QTYPE)
    s_lo, s_hi, low = scales(d_ptr, dmin_ptr, sc_ptr, m_ptr, r, g, mask, s_d, s_dmin, s_sc,
                             s_m, QTYPE)
    if QTYPE == 1 or QTYPE == 3 or QTYPE == 5 or QTYPE == 6:
        w_lo, w_hi = s_lo * q_lo + low, s_hi * q_hi + low
    else:
        w_lo, w_hi = s_lo * q_lo, s_hi * q_hi
    return w_lo, w_hi
