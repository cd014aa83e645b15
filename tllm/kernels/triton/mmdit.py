"""The elementwise work around an MMDiT block's matrix products (Qwen-Image), fused so each
activation is read and written once:

- `adaln_modulate`: optionally the gated residual `x + gate * y`, then LayerNorm (no affine)
  and the AdaLN modulation `norm(x) * (1 + scale) + shift`. Tokens before `split` take
  modulation group 0, the rest group 1 (Qwen-Image's `zero_cond_t`).
- `qk_norm_rope`: RMSNorm of q and k over the head dim, then interleaved-pair RoPE, written
  with v straight into the joint attention buffers at a sequence offset (no concatenation).

Statistics, modulation and RoPE run in float32 with one rounding at the end (diffusers rounds
after each op); the RMSNorm output is rounded before and after its weight, as diffusers does.
The references are `adaln_modulate_ref` and `qk_norm_rope_ref` below."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import next_pow2, row_num_warps


@triton.jit
def _adaln_kernel(h_ptr, x_out_ptr, x_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr,
                  n_tokens, split, n_cols, eps,
                  stride_xb, stride_xt, stride_yb, stride_yt, stride_pb, stride_pg,
                  BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // n_tokens
    t = row % n_tokens
    group = (t >= split).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    params = b * stride_pb + group * stride_pg + cols
    x = tl.load(x_ptr + b * stride_xb + t * stride_xt + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        y = tl.load(y_ptr + b * stride_yb + t * stride_yt + cols, mask=mask, other=0.0)
        gate = tl.load(gate_ptr + params, mask=mask, other=0.0)
        x = (x.to(tl.float32) + gate.to(tl.float32) * y.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, 0) / n_cols
    centered = tl.where(mask, xf - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(centered * centered, 0) / n_cols + eps)
    shift = tl.load(shift_ptr + params, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + params, mask=mask, other=0.0).to(tl.float32)
    h = centered * rstd * (1.0 + scale) + shift
    tl.store(h_ptr + row * n_cols + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


def adaln_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                   split: int | None = None,
                   residual: tuple[torch.Tensor, torch.Tensor] | None = None):
    """x: [B, N, d]; shift, scale (and the gate): [B, G, d] views of one modulation tensor.

    Returns LayerNorm(x) * (1 + scale) + shift, or with `residual=(y, gate)` the pair
    (x + gate * y, that modulation of it)."""
    batch, n_tokens, n_cols = x.shape
    _check_params(shift, scale, *(residual[1:] if residual else ()))
    if x.stride(-1) != 1 or (residual is not None and residual[0].stride(-1) != 1):
        raise ValueError("x and the residual input need a contiguous last dim")
    split = n_tokens if split is None else split
    h = torch.empty((batch, n_tokens, n_cols), dtype=x.dtype, device=x.device)
    y, gate = residual if residual is not None else (x, shift)
    x_out = torch.empty_like(h) if residual is not None else h
    block = next_pow2(n_cols)
    if batch * n_tokens:
        _adaln_kernel[(batch * n_tokens,)](
            h, x_out, x, y, gate, shift, scale, n_tokens, split, n_cols, eps,
            x.stride(0), x.stride(1), y.stride(0), y.stride(1), shift.stride(0),
            shift.stride(1) if shift.shape[1] > 1 else 0,
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=row_num_warps(block))
    return h if residual is None else (x_out, h)


def _check_params(*params: torch.Tensor) -> None:
    """The kernel reads every modulation tensor with the first one's strides."""
    first = params[0]
    for p in params:
        if p.shape != first.shape or p.stride() != first.stride() or p.stride(-1) != 1:
            raise ValueError("modulation tensors must be same-strided views with a "
                             "contiguous last dim")


def adaln_modulate_ref(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                       split: int | None = None,
                       residual: tuple[torch.Tensor, torch.Tensor] | None = None):
    """float32 reference (the new residual rounded to x's dtype, as the kernel stores it)."""
    if residual is not None:
        y, gate = residual
        x = (x.float() + _per_token(gate, x.shape[1], split) * y.float()).to(x.dtype)
    h = torch.nn.functional.layer_norm(x.float(), x.shape[-1:], eps=eps)
    h = h * (1 + _per_token(scale, x.shape[1], split)) + _per_token(shift, x.shape[1], split)
    return h if residual is None else (x, h)


def _per_token(p: torch.Tensor, n_tokens: int, split: int | None) -> torch.Tensor:
    """[B, G, d] group parameters -> [B, N, d] (or [B, 1, d] with one group), float32."""
    p = p.float()
    if p.shape[1] == 1:
        return p
    split = n_tokens if split is None else split
    index = (torch.arange(n_tokens, device=p.device) >= split).long()
    return p[:, index]


@triton.jit
def _norm_rope_heads(dst_ptr, src_ptr, w_ptr, cos, sin, eps, offs, mask, cols, col_mask,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """RMSNorm then RoPE of all heads of one token; pairs are (2i, 2i+1), as in diffusers.
    Loads and stores stay whole rows (vectorized); the pairs are split apart in registers."""
    dtype = src_ptr.dtype.element_ty
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    x = ((x * inv_rms).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D // 2, 2)))
    out = tl.join(even * cos - odd * sin, even * sin + odd * cos)
    tl.store(dst_ptr + offs, tl.reshape(out, (BLOCK_H, BLOCK_D)).to(dst_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
                         n_tokens, offset, eps, stride_in_b, stride_in_t,
                         stride_out_b, stride_out_t,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // n_tokens
    t = row % n_tokens
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    col_mask = cols < HEAD_DIM
    mask = (heads < NUM_HEADS) & col_mask
    offs = heads * HEAD_DIM + cols
    pairs = tl.arange(0, BLOCK_D // 2)[None, :]
    cos = tl.load(cos_ptr + t * (HEAD_DIM // 2) + pairs, mask=pairs < HEAD_DIM // 2, other=0.0)
    sin = tl.load(sin_ptr + t * (HEAD_DIM // 2) + pairs, mask=pairs < HEAD_DIM // 2, other=0.0)
    src = qkv_ptr + b * stride_in_b + t * stride_in_t
    dst = b * stride_out_b + (offset + t) * stride_out_t
    width = NUM_HEADS * HEAD_DIM
    _norm_rope_heads(q_ptr + dst, src, q_w_ptr, cos, sin, eps, offs, mask, cols, col_mask,
                     BLOCK_H, BLOCK_D, HEAD_DIM)
    _norm_rope_heads(k_ptr + dst, src + width, k_w_ptr, cos, sin, eps, offs, mask, cols,
                     col_mask, BLOCK_H, BLOCK_D, HEAD_DIM)
    v = tl.load(src + 2 * width + offs, mask=mask)
    tl.store(v_ptr + dst + offs, v, mask=mask)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float,
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], offset: int) -> None:
    """qkv: [B, T, 3 * H * D], one stream's fused projection; cos, sin: [T, D // 2] float32.

    Writes RMSNorm+RoPE of q and k, and v as is, into out = (q, k, v), each [B, S, H, D]
    contiguous, at sequence positions offset .. offset + T."""
    batch, n_tokens, width3 = qkv.shape
    q_out = out[0]
    num_heads, head_dim = q_out.shape[2:]
    if width3 != 3 * num_heads * head_dim or head_dim % 2 or qkv.stride(-1) != 1:
        raise ValueError("qkv must be [B, T, 3 * H * D] (D even) with a contiguous last dim")
    if any(not t.is_contiguous() or t.shape != q_out.shape for t in out):
        raise ValueError("q, k, v outputs must be contiguous [B, S, H, D] tensors")
    cos, sin = cos.contiguous(), sin.contiguous()
    block_h = next_pow2(num_heads)
    if batch * n_tokens:
        _qk_norm_rope_kernel[(batch * n_tokens,)](
            out[0], out[1], out[2], qkv, q_weight, k_weight, cos, sin, n_tokens, offset, eps,
            qkv.stride(0), qkv.stride(1), q_out.stride(0), q_out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h,
            BLOCK_D=next_pow2(head_dim), num_warps=row_num_warps(block_h * next_pow2(head_dim)))


def qk_norm_rope_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, eps: float, num_heads: int):
    """Returns (q, k, v), each [B, T, H, D]; q and k in float32, v as given."""
    q, k, v = qkv.unflatten(-1, (3, num_heads, -1)).unbind(2)
    return _norm_rope_ref(q, q_weight, cos, sin, eps), _norm_rope_ref(k, k_weight, cos, sin, eps), v


def _norm_rope_ref(x, weight, cos, sin, eps):
    inv_rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    x = ((x.float() * inv_rms).to(x.dtype) * weight).float()
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)
