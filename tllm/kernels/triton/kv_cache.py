"""Writing this step's keys and values into the paged cache at slot_mapping, optionally fused
with rotary embedding (HF rotate-half form) of q and k, so q, k and v are each read once.

A negative slot skips the token (padding rows of a captured CUDA graph). An fp8 (e4m3) cache
stores k / k_scale and v / v_scale (the layer's per-tensor scales; real = fp8 * scale), rounded
to nearest even and saturated at +-448 as tllm.kernels.paged.to_cache does. The references are
`write_kv_ref` and `rope_and_write_kv_ref` below.

Qwen3-style per-head RMSNorms of q and k (`QkNorm`) can run in the same program, before the
rotation: two launches fewer a layer, with the unfused modules' roundings."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tllm.kernels.paged import is_fp8, to_cache
from tllm.kernels.triton.fp8_quant import emulates_fp8_cast, quantize_row_chunk
from tllm.kernels.triton.launch import next_pow2

LLAMA_NORM, GEMMA_NORM = 1, 2  # RMSNorm's rounding (weight on the rounded value), Gemma's


@dataclass(frozen=True)
class QkNorm:
    """Per-head RMSNorms of q and k fused into the rotation: weights [D] each, `kind`
    LLAMA_NORM or GEMMA_NORM."""
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    kind: int


@triton.jit
def _to_cache(x, dst_ptr, scale, FP8: tl.constexpr, EMULATE: tl.constexpr):
    """Values as the cache stores them: cast, or for an fp8 cache divided by the scale."""
    if FP8:
        y = quantize_row_chunk(x.to(tl.float32), scale, EMULATE).to(dst_ptr.dtype.element_ty)
    else:
        y = x.to(dst_ptr.dtype.element_ty)
    return y


@triton.jit
def _copy_heads(dst_ptr, src_ptr, stride_dst_h, stride_src_h, scale, NUM_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                FP8: tl.constexpr, EMULATE: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < HEAD_DIM)
    x = tl.load(src_ptr + offs_h * stride_src_h + offs_d, mask=mask)
    tl.store(dst_ptr + offs_h * stride_dst_h + offs_d, _to_cache(x, dst_ptr, scale, FP8, EMULATE),
             mask=mask)


@triton.jit
def _norm_halves(x1, x2, w_ptr, eps, offs_d, src_ptr, HALF_DIM: tl.constexpr,
                 NORM: tl.constexpr):
    """Each head's (row's) RMSNorm over both halves, in float32: NORM 1 as RMSNorm (rounded
    to src's dtype, times the weight, rounded again), 2 as GemmaRMSNorm (times 1 + weight,
    rounded once); the halves' padding lanes hold 0."""
    DTYPE = src_ptr.dtype.element_ty
    inv_rms = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF_DIM)
                            + eps)[:, None]
    w1 = tl.load(w_ptr + offs_d, mask=offs_d < HALF_DIM, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF_DIM + offs_d, mask=offs_d < HALF_DIM,
                 other=0.0).to(tl.float32)[None, :]
    if NORM == 1:
        x1 = ((x1 * inv_rms).to(DTYPE).to(tl.float32) * w1).to(DTYPE).to(tl.float32)
        x2 = ((x2 * inv_rms).to(DTYPE).to(tl.float32) * w2).to(DTYPE).to(tl.float32)
    else:
        x1 = (x1 * inv_rms * (1.0 + w1)).to(DTYPE).to(tl.float32)
        x2 = (x2 * inv_rms * (1.0 + w2)).to(DTYPE).to(tl.float32)
    return x1, x2


@triton.jit
def _rotate_heads(dst_ptr, src_ptr, cos_ptr, sin_ptr, stride_dst_h, stride_src_h, scale,
                  norm_w_ptr, eps, NUM_HEADS: tl.constexpr, HALF_DIM: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, FP8: tl.constexpr,
                  EMULATE: tl.constexpr, NORM: tl.constexpr):
    """dst = src * cos + rotate_half(src) * sin for all heads of one token, in float32;
    NORM: each head RMS-normalised first (`_norm_halves`)."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS) & (offs_d < HALF_DIM)[None, :]
    cos1 = tl.load(cos_ptr + offs_d, mask=offs_d < HALF_DIM)[None, :]
    cos2 = tl.load(cos_ptr + HALF_DIM + offs_d, mask=offs_d < HALF_DIM)[None, :]
    sin1 = tl.load(sin_ptr + offs_d, mask=offs_d < HALF_DIM)[None, :]
    sin2 = tl.load(sin_ptr + HALF_DIM + offs_d, mask=offs_d < HALF_DIM)[None, :]
    src = src_ptr + offs_h * stride_src_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF_DIM, mask=mask, other=0.0).to(tl.float32)
    if NORM != 0:
        x1, x2 = _norm_halves(x1, x2, norm_w_ptr, eps, offs_d, src_ptr, HALF_DIM, NORM)
    dst = dst_ptr + offs_h * stride_dst_h + offs_d[None, :]
    tl.store(dst, _to_cache(x1 * cos1 - x2 * sin1, dst_ptr, scale, FP8, EMULATE), mask=mask)
    tl.store(dst + HALF_DIM, _to_cache(x2 * cos2 + x1 * sin2, dst_ptr, scale, FP8, EMULATE),
             mask=mask)


@triton.jit
def _write_kv_kernel(
        k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, q_out_ptr, q_ptr, cos_ptr, sin_ptr,
        slot_mapping_ptr, positions_ptr, k_scale, v_scale, q_norm_ptr, k_norm_ptr, eps,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_qt, stride_qh, stride_qot, stride_qoh,
        stride_cos, stride_ckb, stride_ckt, stride_ckh, stride_cvb, stride_cvt, stride_cvh,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        TOKENS_PER_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, APPLY_ROPE: tl.constexpr,
        KV_FP8: tl.constexpr, EMULATE: tl.constexpr, NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    k_src = k_ptr + token * stride_kt
    k_dst = (k_cache_ptr + (slot // TOKENS_PER_BLOCK) * stride_ckb
             + (slot % TOKENS_PER_BLOCK) * stride_ckt)
    if APPLY_ROPE:
        row = tl.load(positions_ptr + token) * stride_cos
        # q is rotated even for a skipped (padding) token: its output is discarded anyway.
        _rotate_heads(q_out_ptr + token * stride_qot, q_ptr + token * stride_qt,
                      cos_ptr + row, sin_ptr + row, stride_qoh, stride_qh, 1.0, q_norm_ptr,
                      eps, NUM_HEADS, HEAD_DIM // 2, BLOCK_H, BLOCK_HALF, False, False, NORM)
        if slot >= 0:
            _rotate_heads(k_dst, k_src, cos_ptr + row, sin_ptr + row, stride_ckh, stride_kh,
                          k_scale, k_norm_ptr, eps, NUM_KV_HEADS, HEAD_DIM // 2, BLOCK_KVH,
                          BLOCK_HALF, KV_FP8, EMULATE, NORM)
    elif slot >= 0:
        _copy_heads(k_dst, k_src, stride_ckh, stride_kh, k_scale, NUM_KV_HEADS, HEAD_DIM,
                    BLOCK_KVH, BLOCK_D, KV_FP8, EMULATE)
    if slot >= 0:
        v_dst = (v_cache_ptr + (slot // TOKENS_PER_BLOCK) * stride_cvb
                 + (slot % TOKENS_PER_BLOCK) * stride_cvt)
        _copy_heads(v_dst, v_ptr + token * stride_vt, stride_cvh, stride_vh, v_scale,
                    NUM_KV_HEADS, HEAD_DIM, BLOCK_KVH, BLOCK_D, KV_FP8, EMULATE)


def _launch(k, v, k_cache, v_cache, slot_mapping, q=None, q_out=None, cos=None, sin=None,
            positions=None, k_scale: float = 1.0, v_scale: float = 1.0,
            qk_norm: QkNorm | None = None) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dimension must be contiguous")
    if is_fp8(k_cache) != is_fp8(v_cache):
        raise ValueError("k_cache and v_cache must both be fp8 or neither")
    if num_tokens == 0:
        return
    rope = q is not None
    q_like = q if rope else k                 # placeholders keep one kernel signature
    q_out_like = q_out if rope else k
    table = cos if rope else slot_mapping
    norm_q, norm_k = (qk_norm.q_weight, qk_norm.k_weight) if qk_norm else (table, table)
    _write_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, q_out_like, q_like, table, sin if rope else slot_mapping,
        slot_mapping, positions if rope else slot_mapping, float(k_scale), float(v_scale),
        norm_q, norm_k, float(qk_norm.eps) if qk_norm else 0.0,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_like.stride(0), q_like.stride(1),
        q_out_like.stride(0), q_out_like.stride(1), table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=q_like.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        TOKENS_PER_BLOCK=k_cache.shape[1], BLOCK_H=next_pow2(q_like.shape[1]),
        BLOCK_KVH=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        BLOCK_HALF=next_pow2(head_dim // 2), APPLY_ROPE=rope, KV_FP8=is_fp8(k_cache),
        EMULATE=emulates_fp8_cast(_write_kv_kernel), NORM=qk_norm.kind if qk_norm else 0,
        num_warps=4)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v [T, Hkv, D] into caches [num_blocks, tokens_per_block, Hkv, D] at slot_mapping;
    the scales apply to fp8 caches only."""
    _launch(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def rope_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      q_out: torch.Tensor | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0, qk_norm: QkNorm | None = None) -> torch.Tensor:
    """Rotates q and k by the cos/sin tables [max_pos, D] at `positions`, writes the rotated
    k and v into the cache, and returns the rotated q (into q_out, which may be q itself);
    with `qk_norm`, each head of q and k RMS-normalised before its rotation."""
    if q.shape[-1] % 2 or q.stride(-1) != 1:
        raise ValueError("rope: q needs an even, contiguous head dimension")
    if q_out is None:
        q_out = torch.empty_like(q)
    _launch(k, v, k_cache, v_cache, slot_mapping, q, q_out, cos.float().contiguous(),
            sin.float().contiguous(), positions, k_scale, v_scale, qk_norm)
    return q_out


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        values = to_cache(x[valid], cache, scale)
        if is_fp8(cache):  # no float8 index_put on every device: write the bytes
            flat.view(torch.uint8)[slots] = values.view(torch.uint8)
        else:
            flat[slots] = values


def rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin


def qk_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: int) -> torch.Tensor:
    """q or k [T, H, D] normalised per head as the kernel does (`_norm_halves`)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == LLAMA_NORM:
        return (h.to(x.dtype).float() * weight.float()).to(x.dtype)
    return (h * (1.0 + weight.float())).to(x.dtype)


def rope_and_write_kv_ref(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                          k_scale: float = 1.0, v_scale: float = 1.0,
                          qk_norm: QkNorm | None = None):
    """float32 reference: returns the rotated q, writes rotated k and v into the cache."""
    if qk_norm is not None:
        q = qk_norm_ref(q, qk_norm.q_weight, qk_norm.eps, qk_norm.kind)
        k = qk_norm_ref(k, qk_norm.k_weight, qk_norm.eps, qk_norm.kind)
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)
    write_kv_ref(rotate_half_ref(k, c, s), v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return rotate_half_ref(q, c, s)
