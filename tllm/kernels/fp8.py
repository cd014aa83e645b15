"""FP8 (e4m3) quantization and scaled matmuls in plain torch: the references of the FP8
kernels, and the exact emulation the CPU runs (dequantize, multiply in float32, scale).

Conventions (as in vLLM, TensorRT-LLM and the checkpoints): a scale is what a quantized value
is multiplied by to give the real one, real = fp8 * scale; dynamic scales are amax / 448."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale
MIN_SCALE = _MIN_SCALE


@dataclass(frozen=True)
class QuantizedActivation:
    """An activation already quantized per token by the op that produced it (RMSNorm,
    SiLU-and-mul), handed to an FP8 linear layer so it need not quantize again.
    `q` fp8 [..., K], `scale` float32 [..., 1] (real = q * scale), `dtype` the unquantized
    activation's dtype: the GEMM's output dtype."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return (self.q.float() * self.scale).to(self.dtype)


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, 1]): one scale per row (token)."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return _to_fp8(x, scale), scale


def quantize_activation(x: torch.Tensor) -> QuantizedActivation:
    """The unfused reference of the norm/activation kernels' fp8 output: x per token."""
    q, scale = quantize_per_token(x)
    return QuantizedActivation(q, scale, x.dtype)


def e4m3_spacing(x: torch.Tensor) -> torch.Tensor:
    """The gap between neighbouring e4m3 values at |x| (3 mantissa bits; subnormal below
    2^-6, a fixed 2^-9): how far apart two roundings of nearly the same value can land."""
    exponent = torch.floor(torch.log2(x.float().abs().clamp(min=2.0 ** -6)))
    return torch.exp2(exponent - 3)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] with a given per-tensor scale -> fp8 [M, K]."""
    return _to_fp8(x, scale.float())


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (fp8 [N, K], float32 scale [N, 1]): one scale per output channel."""
    return quantize_per_token(w)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, ceil(K / group)]): a scale per token and
    group of `group` consecutive columns (the activations of block-scaled GEMMs)."""
    m, k = x.shape
    pad = -k % group
    xp = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, group)
    scale = (xp.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (xp / scale).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k].to(FP8_DTYPE)
    return q, scale[..., 0]


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (fp8 [N, K], float32 scale [ceil(N/bn), ceil(K/bk)]) with one
    scale per bn x bk block (DeepSeek-V3 / Qwen3-FP8's `weight_scale_inv`)."""
    bn, bk = block
    n, k = w.shape
    wp = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    blocks = wp.view(wp.shape[0] // bn, bn, wp.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).view_as(wp)[:n, :k].to(FP8_DTYPE)
    return q, scale[:, 0, :, 0]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """fp8 [N, K] with block scales [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    bn, bk = block
    n, k = q.shape
    full = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return q.float() * full


def scaled_mm_ref(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                  w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale).T with fp32 accumulation: xq [M, K] fp8, x_scale
    [M, 1] or scalar, wq [N, K] fp8, w_scale [N, 1] or scalar -> [M, N] out_dtype."""
    out = xq.float() @ wq.float().t()
    return (out * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
            ).to(out_dtype)


def block_scaled_mm_ref(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                        w_scale: torch.Tensor, block: tuple[int, int],
                        out_dtype: torch.dtype) -> torch.Tensor:
    """Block-scaled GEMM: xq [M, K] fp8 with per-token-group scales [M, ceil(K/bk)], wq
    [N, K] fp8 with block scales [ceil(N/bn), ceil(K/bk)] -> [M, N] out_dtype; each K group's
    partial product is scaled before it is summed (as the kernel does)."""
    bn, bk = block
    m, k = xq.shape
    out = torch.zeros(m, wq.shape[0], dtype=torch.float32, device=xq.device)
    w_scale_rows = w_scale.float().repeat_interleave(bn, dim=0)[:wq.shape[0]]  # [N, kb]
    for g, start in enumerate(range(0, k, bk)):
        part = xq[:, start:start + bk].float() @ wq[:, start:start + bk].float().t()
        out += part * x_scale[:, g:g + 1].float() * w_scale_rows[:, g][None, :]
    return out.to(out_dtype)


def w8a16_mm_ref(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                 block: tuple[int, int] | None = None) -> torch.Tensor:
    """Weight-only FP8: x [M, K] (unquantized) times the dequantized weight, fp32
    accumulation -> [M, N] in x's dtype. `w_scale` is per channel [N, 1] or, with `block`,
    block scales [ceil(N/bn), ceil(K/bk)] (the small-M GEMM kernel's reference)."""
    w = dequantize_blocks(wq, w_scale, block) if block else wq.float() * w_scale.float()
    return (x.float() @ w.t()).to(x.dtype)
