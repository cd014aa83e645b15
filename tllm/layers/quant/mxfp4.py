"""MXFP4 experts (GPT-OSS's checkpoints, `quant_method: "mxfp4"`): every expert's gate_up and
down weights stay in the checkpoint's packed form (tllm.kernels.mxfp4: uint8 blocks of 32
FP4 values and one E8M0 scale each, 4.25 bits a weight), on the GPU multiplied by the Triton
dequant-in-GEMM kernels, on the CPU dequantized one expert at a time. Everything else (the
attention, the router, the embedding, the LM head) is in the model's dtype, as the
checkpoint's `modules_to_not_convert` has it."""
from __future__ import annotations

import torch

from tllm.kernels.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK, dequantize_mxfp4
from tllm.kernels.swiglu_moe import swiglu_experts_ref
from tllm.layers.quant.base import UNQUANTIZED, QuantConfig, QuantMethod

W13_BLOCKS, W13_SCALES, W13_BIAS = "w13_blocks", "w13_scales", "w13_bias"
W2_BLOCKS, W2_SCALES, W2_BIAS = "w2_blocks", "w2_scales", "w2_bias"


class Mxfp4Config(QuantConfig):
    """The experts in MXFP4; every linear layer unquantized."""

    name = "mxfp4"

    def linear_method(self, prefix: str, shard_names: tuple[str, ...] = ()) -> QuantMethod:
        return UNQUANTIZED


class Mxfp4SwigluMoEMethod:
    """GPT-OSS's experts (biases, clamped SwiGLU: tllm.layers.swiglu_moe) from MXFP4 blocks.
    Blocks and scales are [E, rows, K / 32, (16)] with the rows in our order: gate rows, then
    up rows, for w13 (the checkpoint interleaves them; the model splits them at load)."""

    name = "mxfp4"

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def create_weights(self, layer, num_experts: int, hidden_size: int,
                       intermediate_size: int) -> None:
        if layer.tp_size > 1:  # w2's blocks run along the sliced intermediate features
            raise ValueError("MXFP4 experts are not sliced across tensor-parallel ranks: "
                             "pass enable_expert_parallel to place whole experts on ranks")
        for size, name in ((hidden_size, "hidden_size"), (intermediate_size, "intermediate_size")):
            if size % BLOCK_SIZE:
                raise ValueError(f"MXFP4 experts need {name} ({size}) to be a multiple of "
                                 f"{BLOCK_SIZE}")
        rows13, rows2 = 2 * intermediate_size, hidden_size
        groups13, groups2 = hidden_size // BLOCK_SIZE, intermediate_size // BLOCK_SIZE

        def packed(rows: int, groups: int, *tail: int) -> torch.Tensor:
            return torch.empty(num_experts, rows, groups, *tail, dtype=torch.uint8)

        layer.add_expert_param(W13_BLOCKS, packed(rows13, groups13, BYTES_PER_BLOCK), 0)
        layer.add_expert_param(W13_SCALES, packed(rows13, groups13), 0)
        layer.add_expert_param(W13_BIAS, torch.empty(num_experts, rows13), 0)
        layer.add_expert_param(W2_BLOCKS, packed(rows2, groups2, BYTES_PER_BLOCK), None)
        layer.add_expert_param(W2_SCALES, packed(rows2, groups2), None)
        layer.add_expert_param(W2_BIAS, torch.empty(num_experts, rows2), None)

    def process_after_loading(self, layer) -> None:
        """The blocks stay packed."""

    def dequantized(self, layer, expert: int, dtype: torch.dtype):
        """One local expert's (w13 [2I, H], b13, w2 [H, I], b2) in `dtype`."""
        return (dequantize_mxfp4(layer.w13_blocks[expert], layer.w13_scales[expert], dtype),
                layer.w13_bias[expert].to(dtype),
                dequantize_mxfp4(layer.w2_blocks[expert], layer.w2_scales[expert], dtype),
                layer.w2_bias[expert].to(dtype))

    def apply(self, layer, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda:
            from tllm.kernels.triton.swiglu_moe import swiglu_experts_triton
            return swiglu_experts_triton(
                hidden, layer.w13_blocks, layer.w13_bias, layer.w2_blocks, layer.w2_bias,
                topk_weights, topk_ids, self.alpha, self.limit, layer.expert_start,
                w13_scales=layer.w13_scales, w2_scales=layer.w2_scales)
        return swiglu_experts_ref(hidden, lambda e: self.dequantized(layer, e, hidden.dtype),
                                  layer.num_local_experts, topk_weights, topk_ids, self.alpha,
                                  self.limit, layer.expert_start)

    def init_dummy(self, layer, generator: torch.Generator) -> None:
        """Random codes and scales near 2^-6 (weights of magnitude ~0.01-0.1)."""
        for name in (W13_BLOCKS, W2_BLOCKS):
            getattr(layer, name).data.random_(0, 256, generator=generator)
        for name in (W13_SCALES, W2_SCALES):
            getattr(layer, name).data.random_(119, 123, generator=generator)
