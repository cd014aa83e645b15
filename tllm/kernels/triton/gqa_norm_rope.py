"""QK-RMSNorm + rotate-half RoPE for a fused grouped-query QKV projection (Cosmos 3's
mixture-of-transformers blocks, Qwen3-style): one program per token reads its q, k, v heads
from [T, (Hq + 2 * Hk) * D], normalises q and k over the head dim (each optionally: a norm may
be the identity), rotates pairs (i, i + D/2) by the token's angles, and writes q, k, v into
the attention buffers given (views whose rows may sit inside larger buffers, so keys of
several streams land in one tensor without a concatenation).

Statistics and the rotation run in float32; the normalised value is rounded to the input dtype
before and after its weight, as diffusers' RMSNorm does. The reference is `gqa_norm_rope_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import next_pow2, row_num_warps


@triton.jit
def _norm_rope(dst_ptr, src_ptr, w_ptr, cos, sin, eps, heads, halves, mask, dst_head_stride,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    dtype = src_ptr.dtype.element_ty
    lo = tl.load(src_ptr + heads * HEAD_DIM + halves, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src_ptr + heads * HEAD_DIM + HALF + halves, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.math.rsqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / HEAD_DIM + eps)
        w_lo = tl.load(w_ptr + halves, mask=halves < HALF, other=0.0).to(tl.float32)
        w_hi = tl.load(w_ptr + HALF + halves, mask=halves < HALF, other=0.0).to(tl.float32)
        lo = ((lo * inv_rms[:, None]).to(dtype).to(tl.float32) * w_lo).to(dtype).to(tl.float32)
        hi = ((hi * inv_rms[:, None]).to(dtype).to(tl.float32) * w_hi).to(dtype).to(tl.float32)
    out_dtype = dst_ptr.dtype.element_ty
    dst = dst_ptr + heads * dst_head_stride + halves
    tl.store(dst, (lo * cos - hi * sin).to(out_dtype), mask=mask)
    tl.store(dst + HALF, (hi * cos + lo * sin).to(out_dtype), mask=mask)


@triton.jit
def _gqa_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
                          eps, stride_in, stride_q, stride_k, stride_v,
                          stride_qh, stride_kh, stride_vh,
                          NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                          BLOCK_HALF: tl.constexpr, Q_NORM: tl.constexpr,
                          K_NORM: tl.constexpr, WRITE_QV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    halves = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + row * HALF + halves, mask=halves < HALF, other=0.0)
    sin = tl.load(sin_ptr + row * HALF + halves, mask=halves < HALF, other=0.0)
    src = qkv_ptr + row * stride_in
    kv_heads = tl.arange(0, BLOCK_KV)[:, None]
    kv_mask = (kv_heads < NUM_KV) & (halves < HALF)
    _norm_rope(k_ptr + row * stride_k, src + NUM_Q * HEAD_DIM, k_w_ptr, cos, sin, eps, kv_heads,
               halves, kv_mask, stride_kh, HEAD_DIM, HALF, K_NORM)
    if WRITE_QV:
        q_heads = tl.arange(0, BLOCK_Q)[:, None]
        q_mask = (q_heads < NUM_Q) & (halves < HALF)
        _norm_rope(q_ptr + row * stride_q, src, q_w_ptr, cos, sin, eps, q_heads, halves, q_mask,
                   stride_qh, HEAD_DIM, HALF, Q_NORM)
        v_src = src + (NUM_Q + NUM_KV) * HEAD_DIM + kv_heads * HEAD_DIM
        v_dst = v_ptr + row * stride_v + kv_heads * stride_vh
        for part in tl.static_range(2):
            v = tl.load(v_src + part * HALF + halves, mask=kv_mask)
            tl.store(v_dst + part * HALF + halves, v, mask=kv_mask)


def gqa_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float, q_out: torch.Tensor | None, k_out: torch.Tensor,
                  v_out: torch.Tensor | None) -> None:
    """qkv [T, (Hq + 2 * Hk) * D]; cos, sin [T, D // 2] float32; q_out [T, Hq, D] and k_out,
    v_out [T, Hk, D] (each with a contiguous last dim). A None weight skips that norm; with
    q_out and v_out None only k is written (a second normalisation of the same keys)."""
    n_tokens = qkv.shape[0]
    num_kv, head_dim = k_out.shape[1:]
    write_qv = q_out is not None
    num_q = (qkv.shape[1] // head_dim) - 2 * num_kv
    if head_dim % 2 or qkv.stride(-1) != 1 or num_q <= 0:
        raise ValueError("qkv must be [T, (Hq + 2 * Hk) * D] with D even and a contiguous "
                         "last dim")
    outs = [t for t in (q_out, k_out, v_out) if t is not None]
    if any(t.stride(-1) != 1 or t.shape[0] != n_tokens for t in outs):
        raise ValueError("q, k, v outputs must be [T, H, D] with a contiguous last dim")
    if write_qv != (v_out is not None):
        raise ValueError("give both q_out and v_out, or neither")
    q_out = q_out if write_qv else k_out
    v_out = v_out if write_qv else k_out
    cos, sin = cos.contiguous(), sin.contiguous()
    block_q, block_kv = next_pow2(num_q), next_pow2(num_kv)
    if n_tokens:
        _gqa_norm_rope_kernel[(n_tokens,)](
            q_out, k_out, v_out, qkv, q_weight if q_weight is not None else cos,
            k_weight if k_weight is not None else cos, cos, sin, eps, qkv.stride(0),
            q_out.stride(0), k_out.stride(0), v_out.stride(0), q_out.stride(1),
            k_out.stride(1), v_out.stride(1), NUM_Q=num_q, NUM_KV=num_kv, HEAD_DIM=head_dim,
            BLOCK_Q=block_q, BLOCK_KV=block_kv, BLOCK_HALF=next_pow2(head_dim // 2),
            Q_NORM=q_weight is not None, K_NORM=k_weight is not None, WRITE_QV=write_qv,
            num_warps=row_num_warps(block_q * next_pow2(head_dim)))


def gqa_norm_rope_ref(qkv: torch.Tensor, q_weight: torch.Tensor | None,
                      k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      eps: float, num_kv: int, head_dim: int):
    """(q [T, Hq, D], k [T, Hk, D]) in float32 and v [T, Hk, D] as given."""
    num_q = qkv.shape[1] // head_dim - 2 * num_kv
    q, k, v = qkv.unflatten(-1, (-1, head_dim)).split([num_q, num_kv, num_kv], dim=1)
    return _norm_rope_ref(q, q_weight, cos, sin, eps), _norm_rope_ref(k, k_weight, cos, sin,
                                                                      eps), v


def _norm_rope_ref(x, weight, cos, sin, eps):
    if weight is not None:
        inv_rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        x = (x.float() * inv_rms).to(x.dtype) * weight
    x = x.float()
    lo, hi = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].float(), sin[:, None, :].float()
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)
