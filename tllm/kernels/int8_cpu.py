"""int8-weight products on the CPU (W8A16: bf16 activations), with torch's own kernels.

A weight is int8 per output channel, `qweight` [N, K] with `scale` [N] (w = q * scale).
- Few rows (decode): `_weight_int8pack_mm`, a GEMV that reads the int8 weight once; its cost
  grows with every row (it does not block over rows).
- DEQUANT_MIN_ROWS rows or more (prefill, batched decode): the weight is widened a slice at a
  time into a reused scratch buffer (int8 values are exact in bf16 and float32) and multiplied
  by oneDNN's GEMM; the scale is applied to the product. The widened dtype follows the CPU:
  - with native bf16 (AVX512-BF16 or AMX): bf16. On a 2-core Sapphire Rapids VM at SmolLM2's
    shapes, 32 rows took 0.10-0.45 ms a projection against 0.14-0.75 ms for the GEMV kernel,
    256 rows 4-6x less than it; the crossover is about 20 rows (benchmarks/RESULTS.md).
  - without (AVX2 only, e.g. the 2-core AMD EPYC VMs CI runs on): float32, since oneDNN
    emulates a bf16 GEMM there 4x slower than float32's (64 x 576 x 1536: 19.8 ms vs 4.9);
    the activations stay float32 too. The GEMV kernel (bf16, vectorised) wins up to ~40 rows
    (24 rows: 2.2-3.1 ms vs 2.7-3.7 widened; 64 rows: 5.7-7.1 vs 4.3-6.4; 256: 22-24 vs
    14).

With native bf16 both paths see the same bf16 activations and int8 weights and differ only in
where the float32 scale meets the sum; without it the widened path keeps float32 activations,
so a row's result depends on its batch by about bf16's rounding.
`int8_matmul_ref` is what both compute, in float64."""
from __future__ import annotations

import threading

import torch


def _has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


NATIVE_BF16 = _has_native_bf16()
DEQUANT_MIN_ROWS = 24 if NATIVE_BF16 else 40
_SCRATCH_ELEMENTS = 1 << 21   # 4 MB of bf16 (8 of float32) a slice: a layer's weight, or the LM head in parts
_scratch = threading.local()  # one buffer per thread: engines in one process may run at once


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] times the weight [N, K]; the result in x's dtype. `scale` [N] in the
    activations' compute dtype (bf16 for speed; float32 runs torch's scalar loops)."""
    if torch.compiler.is_compiling():
        # opaque to the compiler: Inductor's own code for the widening copy ran ~10x
        # slower than this one's (and the row-count branch would split the trace)
        return torch.ops.tllm.int8_matmul(x, qweight, scale)
    return _int8_matmul(x, qweight, scale)


@torch.library.custom_op("tllm::int8_matmul", mutates_args=())
def _int8_matmul_op(x: torch.Tensor, qweight: torch.Tensor,
                    scale: torch.Tensor) -> torch.Tensor:
    return _int8_matmul(x, qweight, scale)


@_int8_matmul_op.register_fake
def _(x, qweight, scale) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


def _int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] >= DEQUANT_MIN_ROWS:
        wide = scale.dtype if NATIVE_BF16 else torch.float32
        out = _widened_matmul(x2.to(wide).contiguous(), qweight, scale)
    else:
        out = torch.ops.aten._weight_int8pack_mm(x2.to(scale.dtype).contiguous(), qweight,
                                                 scale)
    return out.to(x.dtype).reshape(*shape[:-1], qweight.shape[0])


def _widened_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = qweight.shape
    rows_per_slice = max(1, min(n, _SCRATCH_ELEMENTS // k))
    buf = _scratch_buffer(rows_per_slice * k, x.dtype)[:rows_per_slice * k].view(-1, k)
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for start in range(0, n, rows_per_slice):
        part = buf[:min(rows_per_slice, n - start)]
        part.copy_(qweight[start:start + part.shape[0]])
        torch.matmul(x, part.t(), out=out[:, start:start + part.shape[0]])
    return out.to(torch.float32).mul_(scale.to(torch.float32))


def _scratch_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = _scratch.buf = torch.empty(numel, dtype=dtype)
    return buf


def int8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What int8_matmul computes, in float64: the activations rounded to the scale's dtype."""
    xs = x.reshape(-1, x.shape[-1]).to(scale.dtype).double()
    w = qweight.double() * scale.double()[:, None]
    return (xs @ w.t()).reshape(*x.shape[:-1], qweight.shape[0])
