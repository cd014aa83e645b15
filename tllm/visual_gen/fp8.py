"""FP8 linear layers for the DiT transformers (`VisualGen(..., quantization="fp8")`): every
linear layer inside the transformer's blocks becomes the project's FP8 W8A8 linear
(tllm.layers.quant.fp8: e4m3 weights with a float32 scale per output channel, activations
quantized per token at run time), its weights quantized once as the model loads. On CUDA
the GEMM is cuBLASLt's / Triton's FP8 GEMM; elsewhere the method's exact torch emulation
(weights stored in FP8, multiplied in float32).

Kept in the model's dtype: everything outside the blocks (patch and text embeddings, timestep
MLPs, the output projection) and the blocks' AdaLN modulation linears (a few rows, and the
modulation scales every activation). Attention stays in the model's dtype: torch's SDPA
kernels take no FP8 inputs."""
from __future__ import annotations

import torch
from torch import nn

from tllm.layers.quant.base import WEIGHT, add_param
from tllm.layers.quant.fp8 import Fp8LinearMethod, Fp8Scheme

QUANTIZATIONS = ("fp8",)
# where a DiT keeps its blocks (FLUX: double-stream `blocks`, then `single_blocks`)
BLOCK_LISTS = ("blocks", "single_blocks", "transformer_blocks", "layers")
KEEP = ("mod",)                                             # AdaLN linears: not quantized


class Fp8Linear(nn.Module):
    """A linear layer whose weight is FP8 per output channel (Fp8LinearMethod), bias in the
    model's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.param_layouts: dict = {}
        self.quant = Fp8LinearMethod(Fp8Scheme(checkpoint_is_fp8=False))
        add_param(self, "weight", linear.weight.data, WEIGHT)   # as create_weights would
        self.quant.process_after_loading(self)        # quantizes, per output channel
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant.apply(self, x.contiguous())    # the GPU's quantize kernel: dense rows
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def check_quantization(quantization: str | None, transformer_impl: str) -> None:
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got "
                         f"{quantization!r}")
    if transformer_impl == "diffusers":
        raise ValueError("quantization needs our transformer (transformer_impl 'tllm' or "
                         "'auto'), not diffusers'")


def quantize_pipeline(pipeline) -> int:
    """quantize_transformer on each of the pipeline's transformers (Wan 2.2 A14B's second
    expert too); returns how many layers were swapped."""
    transformers = [pipeline.transformer, getattr(pipeline, "transformer_2", None)]
    return sum(quantize_transformer(t) for t in transformers if t is not None)


@torch.no_grad()
def quantize_transformer(transformer: nn.Module) -> int:
    """Swap the linear layers of the transformer's blocks for Fp8Linear, in place; returns
    how many were swapped."""
    block_lists = [getattr(transformer, name) for name in BLOCK_LISTS
                   if isinstance(getattr(transformer, name, None), nn.ModuleList)]
    if not block_lists:
        raise ValueError(f"quantization: {type(transformer).__name__} has no block list")
    swapped = 0
    for block in (block for blocks in block_lists for block in blocks):
        for name, module in list(block.named_modules()):
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in KEEP:
                parent_name, _, leaf = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, leaf, Fp8Linear(module))
                swapped += 1
    return swapped
