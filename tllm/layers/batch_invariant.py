"""Batch-invariant execution of a model's layers (deterministic mode, `LlmArgs.deterministic`):
a token's result must not depend on how many other tokens share its step.

What varies with the batch on a CPU, as probed on this project's 2-core VMs (torch 2.13,
MKL/oneDNN; tests/layers/test_batch_invariant.py checks the fixes):
- float32 GEMMs: a row's product differs between M = 1 (a GEMV), M = 2..4 and M >= 5 rows,
  and at a few odd M besides (64 -> 128 features: M = 10); at every multiple of 8 from 8 to
  512 it was the same (9 shapes, tiny and SmolLM2's). bf16 GEMMs agreed at every M. So
  every linear layer pads its input rows up to a multiple of `MIN_ROWS` (`padded_rows`).
- The int8 CPU path (tllm.kernels.int8_cpu: GGUF layers and LM heads) switches from a GEMV
  to a GEMM at DEQUANT_MIN_ROWS rows: its layers pad to that many rows, so the GEMM always
  runs. The exact-int4 GGUF form (`gguf_int4`) is not probed.
- Elementwise transcendental ops (silu, sigmoid, gelu): torch runs a vectorised loop and a
  scalar tail, which round differently, and where the tail falls depends on the tensor's
  size and on how its elements are split among threads. `invariant_ops.row_tiled` applies
  such an op to pieces of whole rows, each below torch's parallel grain (one thread) and
  iterated row by row, so a row meets the same vector/tail split whatever its batch.
RMSNorm (one row at a time in torch's kernel), softmax and log_softmax were invariant.

On CUDA (read, not run: no GPU in the session that wrote this): cuBLAS picks a GEMM kernel
(tiles, split-K) by M, so linear layers with a plain float weight and the LM head (one
rank) multiply by tllm.kernels.triton.invariant_matmul (fixed tiles, no split-K); the
padding above also keeps batch-1 decode off the fused GEMV (dense_gemv_dispatch). Quantized
weights keep their own kernels, whose invariance is not claimed. RMSNorm, SiLU-and-mul and
the sampler's noise are Triton kernels that treat every row alike. Attention is
tllm.attention.invariant on any device (the split-K Triton decode kernel is not used); its
products there are cuBLAS batched GEMMs with K and N fixed and M a multiple of 8, not yet
checked on a GPU. CUDA graphs stay off (they need the triton attention backend)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from tllm.layers.embedding import LMHead
from tllm.layers.invariant_ops import MIN_ROWS, padded_rows
from tllm.layers.linear import Linear


def min_rows_of(layer: nn.Module) -> int:
    """The fewest rows `layer`'s kernel must see to compute every row the same way: GGUF
    layers and LM heads re-quantized to int8 on the CPU take int8_matmul, whose path
    changes at DEQUANT_MIN_ROWS."""
    qweight = getattr(layer, "qweight", None)
    if (isinstance(qweight, torch.Tensor) and qweight.dtype == torch.int8
            and qweight.device.type == "cpu"):
        from tllm.kernels.int8_cpu import DEQUANT_MIN_ROWS
        return max(MIN_ROWS, DEQUANT_MIN_ROWS)
    return MIN_ROWS


def _pad_rows(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0]
    module._invariant_rows = x.shape[0]
    missing = padded_rows(x.shape[0], module._invariant_min_rows) - x.shape[0]
    if missing <= 0:
        return None
    return (torch.cat([x, x.new_zeros(missing, *x.shape[1:])]),) + tuple(args[1:])


def _unpad_rows(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out[:module._invariant_rows]


def make_batch_invariant(model: nn.Module, device: torch.device) -> None:
    """Pads every linear layer's and LM head's input rows (hooks) and, on the CPU, makes
    the activations compute in row tiles (CUDA's are Triton kernels, the same code for
    every element). See the module docstring."""
    for module in model.modules():
        # a gated MLP padded as a whole never takes the batch-1 fused GEMV on CUDA
        # (dense_gemv_dispatch.gate_up_silu_mul), which rounds unlike the batched GEMM
        if isinstance(module, (Linear, LMHead)) or hasattr(module, "gate_up_proj"):
            module._invariant_min_rows = min_rows_of(module)
            module.register_forward_pre_hook(_pad_rows)
            module.register_forward_hook(_unpad_rows)
        if device.type == "cuda":
            _use_invariant_matmul(module)
        if hasattr(module, "is_row_tiled") and device.type == "cpu":
            module.is_row_tiled = True


class _InvariantMatmulMethod:
    """The layer's own quantization method, but a plain float weight is multiplied by the
    batch-invariant Triton GEMM (CUDA)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from tllm.kernels.triton.invariant_matmul import invariant_matmul
        return invariant_matmul(x.reshape(-1, x.shape[-1]), layer.weight).view(
            *x.shape[:-1], -1)

    def apply_with_bias(self, layer: nn.Module, x: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
        # its own: __getattr__ would hand over the inner method's fused one
        out = self.apply(layer, x)
        return out if bias is None else out + bias


def _use_invariant_matmul(module: nn.Module) -> None:
    if isinstance(module, Linear) and getattr(module.quant, "plain_weight", False):
        module.quant = _InvariantMatmulMethod(module.quant)
    elif type(module) is LMHead and module.tp_size == 1:
        module.forward = functools.partial(_invariant_lm_head, module)


def _invariant_lm_head(head: LMHead, hidden: torch.Tensor) -> torch.Tensor:
    from tllm.kernels.triton.invariant_matmul import invariant_matmul
    return invariant_matmul(hidden, head.weight)
