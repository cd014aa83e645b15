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
From a 16/32-bit checkpoint (`quantization="fp8"`) each expert's tensor is quantized per row as
it loads (its full rows: the same scales on any number of tp ranks), so the 16-bit experts
are never held at once (Mixtral-8x7B's experts: 45 GB instead of 90); `dummy:` presets
generate theirs one expert at a time."""
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
        fp8 = ref.FP8_DTYPE
        layer.add_expert_param(W13, torch.empty(num_experts, 2 * intermediate_size,
                                                hidden_size, dtype=fp8), intermediate_dim=0)
        layer.add_expert_param(W2, torch.empty(num_experts, hidden_size, intermediate_size,
                                               dtype=fp8), intermediate_dim=1)
        if not self.scheme.checkpoint_is_fp8:  # written with the weights as they load
            layer.register_parameter(W13 + SCALE, _param(num_experts, 2 * intermediate_size, 1))
            layer.register_parameter(W2 + SCALE, _param(num_experts, hidden_size, 1))
            return
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

    def checkpoint_tensor(self, layer, param_name: str, expert_id: int, shard: int | None,
                          tensor: torch.Tensor) -> torch.Tensor:
        """One expert's checkpoint tensor in the layout FusedMoE.load_expert slices: a
        per-tensor or flat per-channel scale as a [rows, 1] column; a 16/32-bit weight
        quantized per row (its scales written here, sliced as the weight is)."""
        if not self.scheme.checkpoint_is_fp8:
            return _quantize_rows(layer, param_name, expert_id, shard, tensor)
        if not param_name.endswith(SCALE):
            return tensor
        rows = (layer.intermediate_size * layer.tp_size if param_name.startswith("w13")
                else layer.hidden_size)
        if tensor.numel() == 1:
            return tensor.float().reshape(1, 1).expand(rows, 1)
        return tensor.float().reshape(-1, 1)

    def process_after_loading(self, layer) -> None:
        """Every form is final once loaded."""

    def init_dummy(self, layer, generator: torch.Generator, std: float = 0.02) -> None:
        """Random normal weights (std `std`), quantized one expert at a time in this
        scheme's form (dummy: presets; never the 16-bit stack at once)."""
        for name in (W13, W2):
            weight = getattr(layer, name).data
            scale = getattr(layer, name + (SCALE if self.block is None else SCALE_INV)).data
            for expert in range(weight.shape[0]):
                w = torch.randn(weight.shape[1:], generator=generator, device=weight.device)
                q, s = (ref.quantize_per_channel(w * std) if self.block is None
                        else ref.quantize_blocks(w * std, self.block))
                weight[expert], scale[expert] = q, s

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


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(_scales(*shape), requires_grad=False)


def _quantize_rows(layer, param_name: str, expert_id: int, shard: int | None,
                   tensor: torch.Tensor) -> torch.Tensor:
    """A 16/32-bit expert weight [rows, cols] -> fp8 with a scale per full row (the same on
    any number of tp ranks), quantized where the layer lives; writes this rank's rows of
    the scales and returns the fp8 tensor for the layer to slice and copy."""
    weight = getattr(layer, param_name)
    q, scale = ref.quantize_per_channel(tensor.to(weight.device))
    scales = getattr(layer, param_name + SCALE).data[expert_id - layer.expert_start]
    size = layer.intermediate_size
    if param_name == W13 and scale.shape[0] == size * layer.tp_size:  # gate or up rows
        scale = scale.narrow(0, layer.tp_rank * size, size)
        scales = scales.narrow(0, shard * size, size)
    if scale.shape == scales.shape:  # else a mis-shaped tensor: load_expert names it
        scales.copy_(scale)
    return q
