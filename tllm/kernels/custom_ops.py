"""Our Triton kernels as torch custom ops (`torch.ops.tllm.*`) with fake implementations, so
that torch.compile traces a decode step around them (Dynamo sees an opaque op with known
output shapes instead of a Python launcher it would break the graph on) and Inductor fuses
the plain-PyTorch code between them.

Eager code keeps calling the kernel wrappers directly (a custom op costs a dispatcher round
trip per call); the layers switch to these ops only while torch.compile traces
(`torch.compiler.is_compiling()`). Importing this module registers the ops; it imports
Triton, so import it only where CUDA kernels run (or under the Triton interpreter)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from tllm.kernels.triton import activation, decode_attention, dense_gemv, kv_cache, rmsnorm
from tllm.kernels.triton.dense_gemv_configs import DenseGemvConfig


@custom_op("tllm::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * norm(x) (tllm/kernels/triton/rmsnorm.py)."""
    return rmsnorm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@custom_op("tllm::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
    """(weight * norm(x + residual), x + residual) in one pass."""
    return rmsnorm.rms_norm(x, weight, eps, residual)


@fused_add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype)),
            torch.empty_like(x))


@custom_op("tllm::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    """x [..., 2 * I] -> silu(gate) * up [..., I]."""
    return activation.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@custom_op("tllm::rope_and_write_kv", mutates_args=("k_cache", "v_cache"))
def rope_and_write_kv(positions: Tensor, q: Tensor, k: Tensor, v: Tensor, cos: Tensor,
                      sin: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> Tensor:
    """Rotated q (a new tensor); k rotated and v written into the paged caches."""
    return kv_cache.rope_and_write_kv(positions, q, k, v, cos, sin, k_cache, v_cache,
                                      slot_mapping, k_scale=k_scale, v_scale=v_scale)


@rope_and_write_kv.register_fake
def _(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0,
      v_scale=1.0) -> Tensor:
    return torch.empty_like(q)


@custom_op("tllm::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    kv_cache.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@write_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    return None


@custom_op("tllm::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           query_start_loc: Tensor, seq_lens: Tensor, max_seq_len: int,
                           scale: float, max_query_len: int = 1,
                           sliding_window: Optional[int] = None, k_scale: float = 1.0,
                           v_scale: float = 1.0,
                           logits_soft_cap: Optional[float] = None,
                           sinks: Optional[Tensor] = None,
                           attention_chunk_size: Optional[int] = None) -> Tensor:
    """Decode attention over the paged cache, [T, Hq, D] like q."""
    return decode_attention.paged_decode_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_seq_len, scale,
        max_query_len=max_query_len, sliding_window=sliding_window, k_scale=k_scale,
        v_scale=v_scale, logits_soft_cap=logits_soft_cap, sinks=sinks,
        attention_chunk_size=attention_chunk_size)


@paged_decode_attention.register_fake
def _(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, max_seq_len, scale,
      max_query_len=1, sliding_window=None, k_scale=1.0, v_scale=1.0,
      logits_soft_cap=None, sinks=None, attention_chunk_size=None) -> Tensor:
    return torch.empty_like(q)


@custom_op("tllm::dense_gemv", mutates_args=())
def dense_gemv_op(x: Tensor, weight: Tensor, block_n: int, block_k: int, num_warps: int,
                  num_stages: int, bias: Optional[Tensor] = None) -> Tensor:
    """x @ weight.T (+ bias) by the small-M GEMV (tllm/kernels/triton/dense_gemv.py)."""
    return dense_gemv.dense_gemv(x, weight, DenseGemvConfig(block_n, block_k, num_warps,
                                                            num_stages), bias)


@dense_gemv_op.register_fake
def _(x, weight, block_n, block_k, num_warps, num_stages, bias=None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@custom_op("tllm::dense_gemv_silu_mul", mutates_args=())
def dense_gemv_silu_mul_op(x: Tensor, weight: Tensor, block_n: int, block_k: int,
                           num_warps: int, num_stages: int) -> Tensor:
    """silu(gate) * up of x times a merged [gate | up] weight, in one GEMV launch."""
    return dense_gemv.dense_gemv_silu_mul(x, weight, DenseGemvConfig(block_n, block_k,
                                                                     num_warps, num_stages))


@dense_gemv_silu_mul_op.register_fake
def _(x, weight, block_n, block_k, num_warps, num_stages) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)
