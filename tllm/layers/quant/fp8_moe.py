"""FP8 W8A8 experts: the MoE method of the FP8 scheme (tllm.layers.quant.fp8), the experts of a
FusedMoE stored in e4m3 with float32 scales and multiplied by tllm.kernels.fp8_moe.

From an FP8 checkpoint (HF `quant_method: "fp8"`, compressed-tensors, ModelOpt), each
expert's gate, up and down load apart with their scales:
  per tensor   one scale per expert and projection, spread over the projection's rows as
               it loads (gate and up keep their own: the dense path's reconciliation of a
               merged layer) -> per-channel form [E, rows, 1];
  per channel  [rows, 1] per projection;
  block        `weight_scale_inv` [rows / bn, cols / bk] per projection; the intermediate
               size (per rank) must be a multiple of bn and bk, so gate and up and the tp
               slices fall on whole blocks.
A checkpoint's static input scales are not used: activations are quantized per token (per
token and bk columns with block scales) at run time, never coarser than the calibration.
From a 16/32-bit checkpoint (`quantization="fp8"`) the experts load in the model's dtype and
are quantized per channel once loaded, one expert at a time."""
from __future__ import annotations

import torch

from tllm.kernels import fp8 as ref
from tllm.kernels.fp8_moe import Fp8Experts, fp8_fused_experts

W13, W2 = "w13_weight", "w2_weight"
SCALE, SCALE_INV = "_scale", "_scale_inv"


class Fp8MoEMethod:
    """The experts of one FusedMoE in fp8 (module docstring), by the layer's Fp8Scheme."""

    name = "fp8"

    def __init__(self, scheme) -> None:
        self.scheme = scheme
        self.block = scheme.block if scheme.weight == "block" else None

    def create_weights(self, layer, num_experts: int, hidden_size: int,
                       intermediate_size: int) -> None:
        if not self.scheme.checkpoint_is_fp8:  # quantized once loaded
            layer.add_expert_param(W13, torch.empty(num_experts, 2 * intermediate_size,
                                                    hidden_size), intermediate_dim=0)
            layer.add_expert_param(W2, torch.empty(num_experts, hidden_size,
                                                   intermediate_size), intermediate_dim=1)
            return
        fp8 = ref.FP8_DTYPE
        layer.add_expert_param(W13, torch.empty(num_experts, 2 * intermediate_size,
                                                hidden_size, dtype=fp8), intermediate_dim=0)
        layer.add_expert_param(W2, torch.empty(num_experts, hidden_size, intermediate_size,
                                               dtype=fp8), intermediate_dim=1)
        if self.block is None:  # per channel (per-tensor checkpoints spread as they load)
            layer.add_expert_param(W13 + SCALE, _scales(num_experts, 2 * intermediate_size, 1),
                                   intermediate_dim=0)
            layer.add_expert_param(W2 + SCALE, _scales(num_experts, hidden_size, 1),
                                   intermediate_dim=None)
            return
        bn, bk = self.block
        for what, size in (("bn", bn), ("bk", bk)):
            if intermediate_size % size:
                raise ValueError(f"fp8 block-scaled experts: the intermediate size per rank "
                                 f"({intermediate_size}) must be a multiple of the weight "
                                 f"block's {what} ({size})")
        layer.add_expert_param(W13 + SCALE_INV,
                               _scales(num_experts, 2 * intermediate_size // bn,
                                       -(-hidden_size // bk)),
                               intermediate_dim=0, units=bn)
        layer.add_expert_param(W2 + SCALE_INV,
                               _scales(num_experts, -(-hidden_size // bn),
                                       intermediate_size // bk),
                               intermediate_dim=1, units=bk)

    def checkpoint_tensor(self, layer, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """One expert's checkpoint tensor in the layout FusedMoE.load_expert slices: a
        per-tensor or flat per-channel scale as a [rows, 1] column."""
        if not param_name.endswith(SCALE):
            return tensor
        rows = (layer.intermediate_size * layer.tp_size if param_name.startswith("w13")
                else layer.hidden_size)
        if tensor.numel() == 1:
            return tensor.float().reshape(1, 1).expand(rows, 1)
        return tensor.float().reshape(-1, 1)

    def process_after_loading(self, layer) -> None:
        if self.scheme.checkpoint_is_fp8:
            return
        for name in (W13, W2):
            _quantize_per_channel(layer, name)

    def experts(self, layer) -> Fp8Experts:
        suffix = SCALE if self.block is None else SCALE_INV
        return Fp8Experts(layer.w13_weight, getattr(layer, W13 + suffix), layer.w2_weight,
                          getattr(layer, W2 + suffix), self.block)

    def apply(self, layer, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return fp8_fused_experts(hidden, self.experts(layer), topk_weights, topk_ids,
                                 layer.expert_start)


def _scales(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.float32)


def _quantize_per_channel(layer, name: str) -> None:
    """A loaded 16/32-bit stacked weight -> fp8 with a float32 scale per row, one expert at
    a time (the full-precision copy of one expert is the only extra memory)."""
    weight = getattr(layer, name).data
    quantized = torch.empty(weight.shape, dtype=ref.FP8_DTYPE, device=weight.device)
    scales = torch.empty(*weight.shape[:2], 1, dtype=torch.float32, device=weight.device)
    for expert in range(weight.shape[0]):
        quantized[expert], scales[expert] = ref.quantize_per_channel(weight[expert])
    dim = layer.intermediate_dims[name]
    delattr(layer, name)
    layer.add_expert_param(name, quantized, intermediate_dim=dim)
    layer.add_expert_param(name + SCALE, scales, intermediate_dim=0 if name == W13 else None)
