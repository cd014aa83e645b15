"""GPT-OSS (OpenAI's open-weight MoE models): the Llama decoder with biased q/k/v/o
projections, attention sinks (a learned logit per head in each softmax's denominator),
sliding-window layers alternating with full ones (`layer_types`), YaRN rope (HF's tables),
and a feed-forward of biased experts with a clamped SwiGLU behind a biased top-k router
(tllm.layers.swiglu_moe). The experts load from a 16-bit checkpoint or stay in the MXFP4
blocks GPT-OSS ships (tllm.layers.quant.mxfp4).

The checkpoint stacks each layer's experts: `mlp.experts.gate_up_proj` [E, H, 2I] with the
gate and up columns interleaved (gate 2j, up 2j + 1), `down_proj` [E, I, H], their biases,
and in MXFP4 `gate_up_proj_blocks` / `_scales` [E, 2I, H / 32, (16)] (rows interleaved the
same way) and `down_proj_blocks` / `_scales` [E, H, I / 32, (16)]."""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tllm.distributed import comm
from tllm.layers.linear import _copy_checked
from tllm.layers.moe import W2, W13, FusedMoE
from tllm.layers.quant import QuantConfig
from tllm.layers.quant.mxfp4 import W2_BLOCKS, W2_SCALES, W13_BLOCKS, W13_SCALES
from tllm.layers.swiglu_moe import W2_BIAS, W13_BIAS, SwigluMoeBlock
from tllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tllm.models.registry import register_model

_EXPERT_TENSOR = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\w+)")
# checkpoint name -> (our parameter, whether gate/up rows interleave, whether [E, in, out])
EXPERT_TENSORS = {
    "gate_up_proj": (W13, True, True), "gate_up_proj_bias": (W13_BIAS, True, False),
    "down_proj": (W2, False, True), "down_proj_bias": (W2_BIAS, False, False),
    "gate_up_proj_blocks": (W13_BLOCKS, True, False),
    "gate_up_proj_scales": (W13_SCALES, True, False),
    "down_proj_blocks": (W2_BLOCKS, False, False), "down_proj_scales": (W2_SCALES, False, False),
}


class GptOssAttention(LlamaAttention):
    """Llama's attention (biases from `attention_bias`) with this rank's heads' sinks."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.head_start = comm.tp_rank_and_size()[0] * self.num_heads

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        """The checkpoint's sinks of every head; this rank keeps its heads'."""
        if name != "sinks":
            raise ValueError(f"{type(self).__name__} has no parameter {name!r}")
        _copy_checked(self.sinks, tensor.narrow(0, self.head_start, self.num_heads), name)


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, config, quant_config: QuantConfig | None, prefix: str):
        return SwigluMoeBlock(config, quant_config, prefix)


@register_model("GptOssForCausalLM")
class GptOssForCausalLM(LlamaForCausalLM):
    layer_cls = GptOssDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors go into the stacked experts here; everything else as in Llama."""
        expert_keys: set[str] = set()

        def other_weights():
            for name, tensor in weights:
                match = _EXPERT_TENSOR.fullmatch(name.removeprefix("model."))
                if match is None:
                    yield name, tensor
                else:
                    expert_keys.update(self._load_experts(name, match, tensor))

        return super().load_weights(other_weights()) | expert_keys

    def _load_experts(self, name: str, match: re.Match, tensor: torch.Tensor) -> set[str]:
        layer = int(match[1])
        if layer not in self.stage_layers:
            return set()
        experts: FusedMoE = self.layers[layer].mlp.experts
        if match[2] not in EXPERT_TENSORS or EXPERT_TENSORS[match[2]][0] not in \
                experts.intermediate_dims:
            raise ValueError(f"checkpoint tensor {name!r} has no place in "
                             f"{type(self).__name__} (quantization "
                             f"{experts.quant.name!r})")
        param, interleaved, transposed = EXPERT_TENSORS[match[2]]
        if tensor.dim() < 2 or tensor.shape[0] != experts.num_experts:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; "
                             f"expected {experts.num_experts} experts along dim 0")
        if transposed:  # [E, in, out] -> our [E, out, in]
            tensor = tensor.transpose(1, 2)
        keys = set()
        for expert in range(experts.expert_start,
                            experts.expert_start + experts.num_local_experts):
            if interleaved:
                keys |= experts.load_expert(param, expert, 0, tensor[expert, 0::2])
                keys |= experts.load_expert(param, expert, 1, tensor[expert, 1::2])
            else:
                keys |= experts.load_expert(param, expert, None, tensor[expert])
        return {f"layers.{layer}.mlp.experts.{key}" for key in keys}

    def expected_weights(self) -> set[str]:
        """Llama's, with each MoE layer's stacked parameters counted per expert and shard."""
        expected = super().expected_weights()
        for name, module in self.named_modules():
            if isinstance(module, FusedMoE):
                expected = {k for k in expected if not k.startswith(f"{name}.")}
                expected |= {f"{name}.{key}" for key in module.expected_keys()}
        return expected
