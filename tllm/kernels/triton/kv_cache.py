"""Writing this step's keys and values into the paged cache at slot_mapping, optionally fused
with rotary embedding (HF rotate-half form) of q and k, so q, k and v are each read once.

A negative slot skips the token (padding rows of a captured CUDA graph). The references are
`write_kv_ref` and `rope_and_write_kv_ref` below."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import next_pow2


@triton.jit
def _copy_heads(dst_ptr, src_ptr, stride_dst_h, stride_src_h, NUM_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_HEADS) & (offs_d < HEAD_DIM)
    x = tl.load(src_ptr + offs_h * stride_src_h + offs_d, mask=mask)
    tl.store(dst_ptr + offs_h * stride_dst_h + offs_d, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(dst_ptr, src_ptr, cos_ptr, sin_ptr, stride_dst_h, stride_src_h,
                  NUM_HEADS: tl.constexpr, HALF_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    """dst = src * cos + rotate_half(src) * sin for all heads of one token, in float32."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS) & (offs_d < HALF_DIM)[None, :]
    cos1 = tl.load(cos_ptr + offs_d, mask=offs_d < HALF_DIM)[None, :]
    cos2 = tl.load(cos_ptr + HALF_DIM + offs_d, mask=offs_d < HALF_DIM)[None, :]
    sin1 = tl.load(sin_ptr + offs_d, mask=offs_d < HALF_DIM)[None, :]
    sin2 = tl.load(sin_ptr + HALF_DIM + offs_d, mask=offs_d < HALF_DIM)[None, :]
    src = src_ptr + offs_h * stride_src_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF_DIM, mask=mask).to(tl.float32)
    dst = dst_ptr + offs_h * stride_dst_h + offs_d[None, :]
    tl.store(dst, (x1 * cos1 - x2 * sin1).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF_DIM, (x2 * cos2 + x1 * sin2).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
        k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, q_out_ptr, q_ptr, cos_ptr, sin_ptr,
        slot_mapping_ptr, positions_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_qt, stride_qh, stride_qot, stride_qoh,
        stride_cos, stride_ckb, stride_ckt, stride_ckh, stride_cvb, stride_cvt, stride_cvh,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        TOKENS_PER_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, APPLY_ROPE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    k_src = k_ptr + token * stride_kt
    k_dst = (k_cache_ptr + (slot // TOKENS_PER_BLOCK) * stride_ckb
             + (slot % TOKENS_PER_BLOCK) * stride_ckt)
    if APPLY_ROPE:
        row = tl.load(positions_ptr + token) * stride_cos
        # q is rotated even for a skipped (padding) token: its output is discarded anyway.
        _rotate_heads(q_out_ptr + token * stride_qot, q_ptr + token * stride_qt,
                      cos_ptr + row, sin_ptr + row, stride_qoh, stride_qh,
                      NUM_HEADS, HEAD_DIM // 2, BLOCK_H, BLOCK_HALF)
        if slot >= 0:
            _rotate_heads(k_dst, k_src, cos_ptr + row, sin_ptr + row, stride_ckh, stride_kh,
                          NUM_KV_HEADS, HEAD_DIM // 2, BLOCK_KVH, BLOCK_HALF)
    elif slot >= 0:
        _copy_heads(k_dst, k_src, stride_ckh, stride_kh, NUM_KV_HEADS, HEAD_DIM,
                    BLOCK_KVH, BLOCK_D)
    if slot >= 0:
        v_dst = (v_cache_ptr + (slot // TOKENS_PER_BLOCK) * stride_cvb
                 + (slot % TOKENS_PER_BLOCK) * stride_cvt)
        _copy_heads(v_dst, v_ptr + token * stride_vt, stride_cvh, stride_vh, NUM_KV_HEADS,
                    HEAD_DIM, BLOCK_KVH, BLOCK_D)


def _launch(k, v, k_cache, v_cache, slot_mapping, q=None, q_out=None, cos=None, sin=None,
            positions=None) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the head dimension must be contiguous")
    if num_tokens == 0:
        return
    rope = q is not None
    q_like = q if rope else k                 # placeholders keep one kernel signature
    q_out_like = q_out if rope else k
    table = cos if rope else slot_mapping
    _write_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, q_out_like, q_like, table, sin if rope else slot_mapping,
        slot_mapping, positions if rope else slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_like.stride(0), q_like.stride(1),
        q_out_like.stride(0), q_out_like.stride(1), table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=q_like.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        TOKENS_PER_BLOCK=k_cache.shape[1], BLOCK_H=next_pow2(q_like.shape[1]),
        BLOCK_KVH=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        BLOCK_HALF=next_pow2(head_dim // 2), APPLY_ROPE=rope, num_warps=4)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into caches [num_blocks, tokens_per_block, Hkv, D] at slot_mapping."""
    _launch(k, v, k_cache, v_cache, slot_mapping)


def rope_and_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotates q and k by the cos/sin tables [max_pos, D] at `positions`, writes the rotated
    k and v into the cache, and returns the rotated q (into q_out, which may be q itself)."""
    if q.shape[-1] % 2 or q.stride(-1) != 1:
        raise ValueError("rope: q needs an even, contiguous head dimension")
    if q_out is None:
        q_out = torch.empty_like(q)
    _launch(k, v, k_cache, v_cache, slot_mapping, q, q_out, cos.float().contiguous(),
            sin.float().contiguous(), positions)
    return q_out


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid].to(v_cache.dtype)


def rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_and_write_kv_ref(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """float32 reference: returns the rotated q, writes rotated k and v into the cache."""
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)
    write_kv_ref(rotate_half_ref(k, c, s), v, k_cache, v_cache, slot_mapping)
    return rotate_half_ref(q, c, s)
