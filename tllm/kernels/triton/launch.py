"""Launch helpers shared by the kernel wrappers."""
from __future__ import annotations

import functools

import torch
import triton

from tllm.kernels.triton import compile_log

compile_log.install_from_env()

_FALLBACK_NUM_SMS = 8  # the interpreter (CPU tensors): small, so tests exercise split paths


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would default to TF32 on tensor cores, which misses the fp32 tolerance."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)  # fixed for a process; not worth a query every step
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _FALLBACK_NUM_SMS
    return _cuda_num_sms(device.index if device.index is not None
                         else torch.cuda.current_device())


def dot_block_d(head_dim: int) -> int:
    """The head-dim tile: a power of two, and at least tl.dot's minimum of 16."""
    return max(16, next_pow2(head_dim))


def row_num_warps(block: int) -> int:
    """Warps for one-row-per-program kernels (norms, activations): ~8 elements a thread."""
    return max(1, min(16, block // 256))


def needs_fp32_dot(kernel, dtype: torch.dtype) -> bool:
    """The Triton interpreter (3.9) holds bf16 as uint16 and multiplies those integers in
    tl.dot; kernels upcast bf16 dot operands to fp32 there. Compiled kernels never do."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return dtype == torch.bfloat16 and isinstance(kernel, InterpretedFunction)
