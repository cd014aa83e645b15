"""The elementwise work around LTX-2's matrix products, fused so each activation is read and
written once:

- `rms_modulate`: optionally the residual `x + gate * y` (gate None: plain `x + y`), then
  RMSNorm without a weight, then none, one or two AdaLN modulations `norm * (1 + scale) +
  shift` of that one norm (LTX-2 modulates one norm twice before its audio/video cross
  attention). Tokens before `split` take modulation group 0, the rest group 1.
- `norm_rope`: RMSNorm of q or k across all heads (LTX-2's "rms_norm_across_heads", one
  statistic per token over H * D, with a weight), then RoPE with per-token tables over the
  whole width: pairs (2i, 2i + 1) ("interleaved") or, per chunk of 2r features, (j, j + r)
  ("split", chunk = head), written contiguously.

Statistics, modulation and rotation run in float32 with one rounding at the end; the RMSNorm
output is rounded before its weight and before the rotation, as diffusers' modules do. The
references are `rms_modulate_ref` and `norm_rope_ref` below (also the CPU path)."""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from tllm.kernels.triton.launch import next_pow2, row_num_warps

ROPE_NONE, ROPE_INTERLEAVED, ROPE_SPLIT = 0, 1, 2

ModParams = tuple[torch.Tensor, torch.Tensor]     # (shift, scale), each [B, G, d]


@triton.jit
def _modulate(h, shift_ptr, scale_ptr, stride_b, stride_g, out_ptr, b, group, row, cols,
              mask, n_cols):
    base = b * stride_b + group * stride_g + cols
    shift = tl.load(shift_ptr + base, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + base, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (h * (1.0 + scale) + shift).to(
        out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_modulate_kernel(x_ptr, y_ptr, gate_ptr, x_out_ptr, h0_ptr, h1_ptr,
                         shift0_ptr, scale0_ptr, shift1_ptr, scale1_ptr,
                         n_tokens, split, n_cols, eps,
                         stride_xb, stride_xt, stride_yb, stride_yt, stride_gb, stride_gg,
                         stride_0b, stride_0g, stride_1b, stride_1g,
                         BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         HAS_GATE: tl.constexpr, NUM_MODS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // n_tokens
    t = row % n_tokens
    group = (t >= split).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + b * stride_xb + t * stride_xt + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        y = tl.load(y_ptr + b * stride_yb + t * stride_yt + cols, mask=mask,
                    other=0.0).to(tl.float32)
        if HAS_GATE:
            gate = tl.load(gate_ptr + b * stride_gb + group * stride_gg + cols, mask=mask,
                           other=0.0).to(tl.float32)
            y = gate * y
        x = (x.to(tl.float32) + y).to(x_ptr.dtype.element_ty)
        tl.store(x_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    h = xf * rstd
    if NUM_MODS == 0:
        tl.store(h0_ptr + row * n_cols + cols, h.to(h0_ptr.dtype.element_ty), mask=mask)
    if NUM_MODS >= 1:
        _modulate(h, shift0_ptr, scale0_ptr, stride_0b, stride_0g, h0_ptr, b, group, row, cols,
                  mask, n_cols)
    if NUM_MODS == 2:
        _modulate(h, shift1_ptr, scale1_ptr, stride_1b, stride_1g, h1_ptr, b, group, row, cols,
                  mask, n_cols)


def rms_modulate(x: torch.Tensor, mods: Sequence[ModParams], eps: float,
                 split: int | None = None,
                 residual: tuple[torch.Tensor, torch.Tensor | None] | None = None):
    """x: [B, N, d]; mods: up to two (shift, scale) pairs of [B, G, d] (G = 1 or 2) views.

    Returns the list of outputs (the plain norm when `mods` is empty, else one modulation per
    pair), and with `residual=(y, gate)` first the new x = x + gate * y: (x, outputs)."""
    batch, n_tokens, n_cols = x.shape
    if len(mods) > 2:
        raise ValueError("rms_modulate takes at most two modulations")
    params = [p for pair in mods for p in pair]
    y, gate = residual if residual is not None else (None, None)
    if gate is not None:
        params.append(gate)
    for p in params:
        if p.dim() != 3 or p.shape[0] != batch or p.shape[-1] != n_cols or p.stride(-1) != 1:
            raise ValueError("modulation tensors must be [B, G, d] with a contiguous last dim")
    if x.stride(-1) != 1 or (y is not None and y.stride(-1) != 1):
        raise ValueError("x and the residual input need a contiguous last dim")
    _check_same_strides(mods)
    outs = [torch.empty_like(x, memory_format=torch.contiguous_format)
            for _ in range(max(1, len(mods)))]
    x_out = torch.empty_like(outs[0]) if residual is not None else x
    pairs = [*mods, *([mods[0] if mods else (x, x)] * (2 - len(mods)))]
    (s0, c0), (s1, c1) = pairs
    g = gate if gate is not None else x
    if batch * n_tokens:
        block = next_pow2(n_cols)
        _rms_modulate_kernel[(batch * n_tokens,)](
            x, y if y is not None else x, g, x_out, outs[0], outs[-1], s0, c0, s1, c1,
            n_tokens, n_tokens if split is None else split, n_cols, eps,
            x.stride(0), x.stride(1), *(_strides2(y) if y is not None else (0, 0)),
            *_group_strides(g), *_group_strides(s0), *_group_strides(s1),
            BLOCK=block, HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None,
            NUM_MODS=len(mods), num_warps=row_num_warps(block))
    return outs if residual is None else (x_out, outs)


def _strides2(t: torch.Tensor) -> tuple[int, int]:
    return t.stride(0), t.stride(1)


def _group_strides(p: torch.Tensor) -> tuple[int, int]:
    """(batch, group) strides; one group is read at every token (group stride 0)."""
    if p.dim() != 3:
        return 0, 0
    return p.stride(0), p.stride(1) if p.shape[1] > 1 else 0


def _check_same_strides(mods: Sequence[ModParams]) -> None:
    """The kernel reads a pair's shift and scale with the shift's strides."""
    for shift, scale in mods:
        if _group_strides(shift) != _group_strides(scale) or shift.shape != scale.shape:
            raise ValueError("a modulation's shift and scale must be same-strided views")


def rms_modulate_ref(x: torch.Tensor, mods: Sequence[ModParams], eps: float,
                     split: int | None = None,
                     residual: tuple[torch.Tensor, torch.Tensor | None] | None = None):
    """diffusers' numerics: the residual in x's dtype, the norm's statistics in float32 and
    its output rounded to x's dtype, the modulation in x's dtype."""
    if residual is not None:
        y, gate = residual
        x = x + (y if gate is None else y * per_token(gate, x.shape[1], split))
    variance = x.float().pow(2).mean(-1, keepdim=True)
    h = (x * torch.rsqrt(variance + eps)).to(x.dtype)
    outs = [h * (1 + per_token(scale, x.shape[1], split)) + per_token(shift, x.shape[1], split)
            for shift, scale in mods] or [h]
    return outs if residual is None else (x, outs)


def per_token(p: torch.Tensor, n_tokens: int, split: int | None) -> torch.Tensor:
    """[B, G, d] group parameters -> broadcastable over [B, n_tokens, d]."""
    if p.shape[1] == 1:
        return p
    split = n_tokens if split is None else split
    index = (torch.arange(n_tokens, device=p.device) >= split).long()
    return p[:, index]


@triton.jit
def _norm_rope_kernel(out_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, n_tokens, n_cols, eps,
                      stride_xb, stride_xt, stride_tab,
                      BLOCK_P: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // n_tokens
    t = row % n_tokens
    pairs = tl.arange(0, BLOCK_P)
    mask = pairs < n_cols // 2
    if MODE == 2:       # split: pair j of chunk c is (c * 2r + j, c * 2r + r + j)
        first = (pairs // HALF) * (2 * HALF) + pairs % HALF
        second = first + HALF
    else:
        first = 2 * pairs
        second = first + 1
    src = x_ptr + b * stride_xb + t * stride_xt
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / n_cols + eps)
    w1 = tl.load(w_ptr + first, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + second, mask=mask, other=0.0).to(tl.float32)
    x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    if MODE != 0:
        cos = tl.load(cos_ptr + t * stride_tab + pairs, mask=mask, other=1.0)
        sin = tl.load(sin_ptr + t * stride_tab + pairs, mask=mask, other=0.0)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    dst = out_ptr + row * n_cols
    tl.store(dst + first, x1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second, x2.to(out_ptr.dtype.element_ty), mask=mask)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
              split_chunks: int | None = None) -> torch.Tensor:
    """x: [B, N, C] (rows may be strided, e.g. a slice of a fused projection); cos, sin:
    [N, C / 2] float32 per rotated pair, or None for no rotation; split_chunks: the number of
    chunks of the "split" layout (None: interleaved). Returns [B, N, C] contiguous."""
    batch, n_tokens, n_cols = x.shape
    if n_cols % 2 or x.stride(-1) != 1:
        raise ValueError("x must have an even, contiguous last dim")
    mode = ROPE_NONE if cos is None else (ROPE_INTERLEAVED if split_chunks is None
                                          else ROPE_SPLIT)
    half = 1
    if mode != ROPE_NONE:
        if cos.shape != (n_tokens, n_cols // 2) or sin.shape != cos.shape:
            raise ValueError(f"rope tables must be [{n_tokens}, {n_cols // 2}]")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        if mode == ROPE_SPLIT:
            if n_cols % (2 * split_chunks):
                raise ValueError("the width must be a multiple of 2 * split_chunks")
            half = n_cols // (2 * split_chunks)
    out = torch.empty((batch, n_tokens, n_cols), dtype=x.dtype, device=x.device)
    if batch * n_tokens:
        block = next_pow2(n_cols // 2)
        tables = (cos, sin) if cos is not None else (weight, weight)
        _norm_rope_kernel[(batch * n_tokens,)](
            out, x, weight, *tables, n_tokens, n_cols, eps, x.stride(0), x.stride(1),
            n_cols // 2, BLOCK_P=block, MODE=mode, HALF=half,
            num_warps=row_num_warps(2 * block))
    return out


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                  split_chunks: int | None = None) -> torch.Tensor:
    """diffusers' numerics: torch's RMSNorm over the width, then the rotation in float32,
    rounded once to x's dtype."""
    x = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    if cos is None:
        return x
    return apply_rope(x, cos, sin, split_chunks)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               split_chunks: int | None) -> torch.Tensor:
    """Rotate the pairs of x [..., N, C] by per-token angles (cos, sin [N, C / 2])."""
    dtype = x.dtype
    xf = x.float()
    if split_chunks is None:
        first, second = xf[..., 0::2], xf[..., 1::2]
    else:
        chunks = xf.unflatten(-1, (split_chunks, 2, -1))
        first, second = chunks[..., 0, :].flatten(-2), chunks[..., 1, :].flatten(-2)
    new_first = first * cos - second * sin
    new_second = second * cos + first * sin
    if split_chunks is None:
        out = torch.stack([new_first, new_second], -1).flatten(-2)
    else:
        out = torch.stack([new_first.unflatten(-1, (split_chunks, -1)),
                           new_second.unflatten(-1, (split_chunks, -1))], -2).flatten(-3)
    return out.to(dtype)
