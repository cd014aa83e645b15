"""GGUF weights kept in their block formats on a CUDA device: the GPU side of the methods in
tllm.layers.quant.gguf (which call these once the checkpoint is loaded, by device).

A linear layer's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are repacked once into
the planes of tllm.kernels.gguf, one flat uint8 buffer the size of the file's tensor (+3% for
Q4_K/Q5_K), and multiplied by the Triton kernels of tllm.kernels.triton.gguf_gemm: a GEMV at
one row, a fused dequantize-dot at a few, torch.matmul on the decoded weight for a prefill.
A merged layer whose projections come in different types (a Q6_K v beside Q4_K q and k in
Q4_K_M files) reaches the method as float rows; it is re-quantized to Q8_0 (its own 32-value
blocks, ~0.4% weight error against what the file holds, as the CPU's int8 rows add ~0.8%).
The token embedding keeps its planes and decodes the rows it looks up; the LM head (tied to it
or its own) runs the same GEMV/GEMM on them, so a tied pair holds one buffer."""
from __future__ import annotations

import torch
from torch import nn

from tllm.kernels.gguf import KERNEL_TYPES, GgufPlanes, dequantize_planes, pack_planes, planes_view
from tllm.layers.quant.base import WEIGHT, add_param


def uses_planes(weight: torch.Tensor) -> bool:
    """Whether GGUF weights on this tensor's device take the planes and kernels (CUDA; tests
    patch this to run them on the CPU under the Triton interpreter)."""
    return weight.device.type == "cuda"


def has_kernel(qtype: str | None) -> bool:
    return qtype in KERNEL_TYPES


def to_planes(param: nn.Parameter, qtype: str) -> None:
    """Blocks [rows, blocks, bytes] -> the flat planes buffer, in place (a tied layer holding
    the same parameter sees it too, and then finds it done)."""
    if param.dim() == 3:
        param.data = pack_planes(param.data, qtype)


def planes(param: nn.Parameter, qtype: str, n: int, k: int) -> GgufPlanes:
    """The planes inside `param` (views, made once per buffer and kept on the parameter)."""
    cached = getattr(param, "_gguf_planes", None)
    if cached is None or cached[0] != param.data_ptr():
        cached = (param.data_ptr(), planes_view(param.data, qtype, n, k))
        param._gguf_planes = cached
    return cached[1]


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] -> Q8_0 blocks [N, K / 32, 34] as gguf-py quantizes them:
    d = max |w| / 127 per 32 values (stored fp16), q = round(w / d) half away from zero."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs rows of whole 32-value blocks, got {k}")
    w = weight.float().reshape(n, k // 32, 32)
    d = w.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = w * inv
    q = (scaled.sign() * torch.floor(scaled.abs() + 0.5)).to(torch.int8)
    d16 = d.to(torch.float16).view(torch.uint8).reshape(n, k // 32, 2)
    return torch.cat((d16, q.view(torch.uint8)), dim=-1)


class GpuLinear:
    """The run-time form of a GGUF linear layer on CUDA: its planes buffer `gguf_planes`."""

    PARAM = "gguf_planes"

    @staticmethod
    def convert(layer: nn.Module, qtype: str | None) -> str:
        """Repack the loaded weight; returns the type kept (Q8_0 for float rows)."""
        raw = layer.weight.data
        if qtype is None:
            raw, qtype = quantize_q8_0(raw), "Q8_0"
        buffer = pack_planes(raw, qtype)
        delattr(layer, "weight")
        add_param(layer, GpuLinear.PARAM, buffer, WEIGHT)
        layer.gguf_shape = (raw.shape[0], layer.in_features)
        return qtype

    @staticmethod
    def planes(layer: nn.Module, qtype: str) -> GgufPlanes:
        return planes(getattr(layer, GpuLinear.PARAM), qtype, *layer.gguf_shape)

    @staticmethod
    def apply(layer: nn.Module, qtype: str, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, GpuLinear.planes(layer, qtype))

    @staticmethod
    def dequantized_weight(layer: nn.Module, qtype: str) -> torch.Tensor:
        return dequantize_planes(GpuLinear.planes(layer, qtype))


def matmul(x: torch.Tensor, weight: GgufPlanes) -> torch.Tensor:
    """x [..., K] (model dtype) times the planes' weight^T -> [..., N] in x's dtype."""
    from tllm.kernels.triton.gguf_gemm import gguf_mm
    shape = x.shape
    out = gguf_mm(x.reshape(-1, shape[-1]).contiguous(), weight)
    return out.reshape(*shape[:-1], out.shape[-1])


def decode_rows(weight: GgufPlanes, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Embedding lookups: rows `ids` [T] decoded -> [T, K] in `dtype` (exact in float32, as
    gguf computes them, then rounded once)."""
    from tllm.kernels.triton.gguf_gemm import gguf_dequantize
    return gguf_dequantize(weight, ids, dtype)
