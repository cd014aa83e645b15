"""The FP8 GEMMs a linear layer calls, by device: on CUDA cuBLASLt (`torch._scaled_mm`) and
the Triton kernels; elsewhere the exact torch emulation of tllm.kernels.fp8 (CI runs it).

On CUDA with bf16/fp16 activations (`gemm_path` says which; the Triton modules are imported
only there):
  M <= SMALL_M   `small_m`: the weight-streaming W8A16 kernel (fp8 weights widened in
                 registers times the unquantized activations): no activation quantization
                 pass, weights read once. A static input scale is not needed there and is
                 not used (the activations keep their precision).
  larger M       activations quantized in one Triton pass (per token, or with the static
                 input scale) unless the op before already did (a QuantizedActivation from
                 the fused RMSNorm / SiLU-and-mul kernels), then
                   `scaled_mm`: torch._scaled_mm row-wise (per-token x per-channel) for bf16
                   output with K and N multiples of 16 (cuBLASLt's constraints; the weight is
                   row-major [N, K], so weight.t() is the column-major mat2 it wants);
                   `triton_mm`: the Triton W8A8 GEMM for every other shape and for fp16.
  block scales   M <= SMALL_M: the W8A16 kernel with block scales; else per-token-group
                 quantization (Triton) and the Triton block-scaled GEMM. A scale block whose
                 K side is not a power of two >= 16 takes the emulation.
Elsewhere (CPU, fp32 activations) the emulation runs, as before."""
from __future__ import annotations

import torch

from tllm.kernels import fp8 as ref
from tllm.kernels.fp8 import QuantizedActivation

# Rows up to which the weight-streaming kernel runs. Measured on the H200 (benchmarks/
# gpu_fp8.py, 2026-12-01), Llama-3.1-8B shapes: at M = 1 its GEMV form beats bf16 by 1.2-1.6x
# and _scaled_mm by 1.3-1.8x; at M = 8 and 32 its tl.dot form lost to _scaled_mm (e.g.
# gate_up: 53 / 62 us vs 45 / 44 us), so only M = 1 takes it.
SMALL_M = 1
_FAST_DTYPES = (torch.bfloat16, torch.float16)


def gemm_path(x: torch.Tensor | QuantizedActivation, n: int, k: int,
              block: tuple[int, int] | None = None) -> str:
    """Which GEMM fp8_linear / block_fp8_linear run for x [M, K] and an [N, K] weight:
    "emulation", "small_m", "scaled_mm", "triton_mm" or "triton_block"."""
    dtype = x.dtype
    on_gpu = x.q.is_cuda if isinstance(x, QuantizedActivation) else x.is_cuda
    if not on_gpu or dtype not in _FAST_DTYPES:
        return "emulation"
    if block is not None and not _triton_block_ok(block):
        return "emulation"
    if not isinstance(x, QuantizedActivation) and x.shape[0] <= SMALL_M:
        return "small_m"
    if block is not None:  # an fp8 x fp8 tl.dot needs K >= 32 on Hopper (16 fails to compile)
        return "triton_block" if block[1] >= 32 else "emulation"
    if dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0:
        return "scaled_mm"
    return "triton_mm"


def takes_quantized_input(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether an fp8 linear layer (per-channel weights, dynamic per-token activations) would
    quantize x per token itself, so the op producing x may hand it over quantized instead."""
    return gemm_path(x, n, k) in ("scaled_mm", "triton_mm")


def fp8_linear(x: torch.Tensor | QuantizedActivation, weight: torch.Tensor,
               weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (model dtype, or already quantized per token) times an fp8 weight [N, K] with
    per-channel scales [N, 1]; activations quantized per token, or with the static
    per-tensor `input_scale`."""
    n, k = weight.shape
    path = gemm_path(x, n, k)
    if path == "emulation":
        if isinstance(x, QuantizedActivation):
            return ref.scaled_mm_ref(x.q, x.scale, weight, weight_scale, x.dtype)
        return _emulated_linear(x, weight, weight_scale, input_scale)
    from tllm.kernels.triton import fp8_gemm, fp8_quant
    if path == "small_m":
        return fp8_gemm.w8a16_mm(x, weight, weight_scale)
    if isinstance(x, QuantizedActivation):
        xq, x_scale, dtype = x.q, x.scale, x.dtype
    elif input_scale is None:
        (xq, x_scale), dtype = fp8_quant.quantize_per_token(x), x.dtype
    else:
        xq, dtype = fp8_quant.quantize_static(x, input_scale), x.dtype
        x_scale = input_scale.float().reshape(1, 1).expand(xq.shape[0], 1).contiguous()
    if path == "scaled_mm":
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale,
                                scale_b=weight_scale.float().reshape(1, -1), out_dtype=dtype)
    return fp8_gemm.fp8_mm(xq, x_scale, weight, weight_scale, dtype)


def _emulated_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None) -> torch.Tensor:
    if input_scale is None:
        xq, x_scale = ref.quantize_per_token(x)
    else:
        xq, x_scale = ref.quantize_static(x, input_scale), input_scale.float().reshape(1, 1)
    return ref.scaled_mm_ref(xq, x_scale, weight, weight_scale, x.dtype)


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] times an fp8 weight [N, K] with block scales [ceil(N/bn), ceil(K/bk)];
    activations quantized per token and group of bk columns."""
    n, k = weight.shape
    path = gemm_path(x, n, k, block)
    if path == "emulation":
        xq, x_scale = ref.quantize_per_token_group(x, block[1])
        return ref.block_scaled_mm_ref(xq, x_scale, weight, weight_scale, block, x.dtype)
    from tllm.kernels.triton import fp8_gemm, fp8_quant
    if path == "small_m":
        return fp8_gemm.w8a16_mm(x, weight, weight_scale, block)
    xq, x_scale = fp8_quant.quantize_per_token_group(x, block[1])
    return fp8_gemm.fp8_mm(xq, x_scale, weight, weight_scale, x.dtype, block)


def _triton_block_ok(block: tuple[int, int]) -> bool:
    bk = block[1]
    return bk >= 16 and bk & (bk - 1) == 0
