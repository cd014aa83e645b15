"""When a layer multiplies by the dense small-M GEMV (tllm.kernels.triton.dense_gemv) instead
of cuBLAS: batch-1 decode (one flattened token), CUDA, bf16/fp16, a plain row-major weight
(with a bias: the plain GEMV adds it; the gated one takes none), and a shape the device's
table says the GEMV wins (`"use": true`). The two
environment switches are read here and nowhere else:

  TLLM_DENSE_GEMV=auto (default) | 1 | 0   auto: the table decides; 1: every eligible call
                                           takes the GEMV (the table's launch, else the
                                           default); 0: never (cuBLAS, as before)
  TLLM_DENSE_GEMV_CONFIGS=/path.json       a table (benchmarks/gpu_gemv.py --write-table)
                                           in place of configs/dense_gemv_<device>.json

Eager code calls the kernels directly; under torch.compile the same calls go through the
torch custom ops tllm::dense_gemv / tllm::dense_gemv_silu_mul (tllm.kernels.custom_ops), so
the compiler keeps each launch whole. The decision is made at trace time (shapes are static
there) and so is baked into the compiled graph, as it is into a captured CUDA graph."""
from __future__ import annotations

import functools
import os

import torch
from torch import nn

from tllm.layers.activation import SiluAndMul

from tllm.kernels.triton.dense_gemv_configs import (DEFAULT_CONFIGS, DenseGemvConfig,
                                                    table_entry)

MODE_ENV = "TLLM_DENSE_GEMV"
TABLE_ENV = "TLLM_DENSE_GEMV_CONFIGS"
MODES = ("auto", "0", "1")
_DTYPES = (torch.bfloat16, torch.float16)


def gemv_mode() -> str:
    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def decide(kind: str, n: int, k: int, device: torch.device) -> DenseGemvConfig | None:
    """The GEMV's launch for a [n, k] weight of `kind` ("plain", "silu_mul") on `device`,
    or None: keep cuBLAS."""
    launch = _decided_launch(kind, n, k, device.type, device.index)
    return None if launch is None else DenseGemvConfig(*launch)


def _assume_constant_result(fn):
    """What `torch.compiler.assume_constant_result` does (mark `fn` for Dynamo), without
    the decorator's import of torch._dynamo: ~1.4 s of every CPU start that never compiles
    (tests/layers/test_dense_gemv_dispatch.py checks the mark against torch's own)."""
    fn._dynamo_marked_constant = True
    return fn


# Dynamo cannot trace the table's file reads: under torch.compile this runs at trace time
# and its answer (ints, or None) goes into the graph as a constant
@_assume_constant_result
def _decided_launch(kind: str, n: int, k: int, device_type: str,
                    device_index: int | None) -> tuple[int, int, int, int] | None:
    return _launch_for(gemv_mode(), os.environ.get(TABLE_ENV) or None, kind, n, k,
                       device_type, device_index)


@functools.lru_cache(maxsize=4096)   # eager decode asks once a layer a step
def _launch_for(mode: str, table: str | None, kind: str, n: int, k: int, device_type: str,
                device_index: int | None) -> tuple[int, int, int, int] | None:
    if mode == "0":
        return None
    entry = table_entry(kind, n, k, torch.device(device_type, device_index), table)
    if mode == "1":
        return _launch_args(entry.config if entry is not None else DEFAULT_CONFIGS[kind])
    return _launch_args(entry.config) if entry is not None and entry.use else None


def _runs_kernels(x) -> bool:
    # x may be an fp8 QuantizedActivation (an FP8 layer's input), which the GEMV never takes
    return isinstance(x, torch.Tensor) and x.is_cuda


def eligible(x: torch.Tensor, weight: torch.Tensor, bias, bias_ok: bool = False) -> bool:
    """One flattened token, the GEMV's dtypes, a plain row-major weight; no bias, or with
    `bias_ok` (the plain GEMV adds it) a contiguous one in x's dtype."""
    if bias is not None and not (bias_ok and isinstance(bias, torch.Tensor)
                                 and bias.dtype == x.dtype and bias.dim() == 1
                                 and bias.stride(0) == 1):
        return False
    return (_runs_kernels(x) and x.dtype in _DTYPES
            and x.numel() == x.shape[-1] and isinstance(weight, torch.Tensor)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1)


def dense_linear(layer: nn.Module, x: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ layer.weight.T (+ bias, in the epilogue) by the GEMV where it is eligible and
    enabled; None: the caller runs F.linear."""
    if not _runs_kernels(x):  # first: the CPU path pays one check
        return None
    weight = layer.weight
    if not eligible(x, weight, bias, bias_ok=True):
        return None
    return _multiply("plain", x, weight, bias)


def gate_up_silu_mul(gate_up: nn.Module, act: nn.Module, down: nn.Module,
                     x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a merged gate/up layer in one GEMV launch, where the layer's weight
    is plain (no LoRA, no quantization, no bias), `act` is SiLU-and-mul and the down
    projection takes its input as it is (not fp8); None: the caller runs the unfused path."""
    if (not _runs_kernels(x) or not getattr(gate_up.quant, "plain_weight", False)
            or type(act) is not SiluAndMul
            or not eligible(x, gate_up.weight, gate_up.bias) or _wants_fp8_input(down, x)):
        return None
    return _multiply("silu_mul", x, gate_up.weight)


def _multiply(kind: str, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """The GEMV of `kind` (bias: "plain" only) where the table enables it (None: the
    caller's cuBLAS path); the custom op while torch.compile traces, the kernel otherwise."""
    config = decide(kind, weight.shape[0], weight.shape[1], x.device)
    if config is None:
        return None
    if torch.compiler.is_compiling():
        from tllm.kernels import custom_ops
        if kind == "plain":
            return custom_ops.dense_gemv_op(x, weight, *_launch_args(config), bias)
        return custom_ops.dense_gemv_silu_mul_op(x, weight, *_launch_args(config))
    from tllm.kernels.triton import dense_gemv as kernels
    if kind == "plain":
        return kernels.dense_gemv(x, weight, config, bias)
    return kernels.dense_gemv_silu_mul(x, weight, config)


def _wants_fp8_input(down: nn.Module, x: torch.Tensor) -> bool:
    """Whether the down projection asks for its input quantized by the activation's kernel
    (tllm.layers.quant.fp8.input_quantization; looked up on the method, not imported:
    the quantization methods import this module)."""
    asks = getattr(down.quant, "input_quantization", None)
    return asks is not None and asks(down, x) is not None


def _launch_args(config: DenseGemvConfig) -> tuple[int, int, int, int]:
    return config.block_n, config.block_k, config.num_warps, config.num_stages
