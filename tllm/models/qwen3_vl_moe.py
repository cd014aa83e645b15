"""Qwen3-VL-MoE: Qwen3-VL (interleaved M-RoPE, DeepStack, transformers' vision tower) on the
Qwen3-MoE decoder (no shared expert; the top-k routing weights always renormalized, as
transformers' Qwen3VLMoeTextTopKRouter does). The hub's checkpoints store the stacked
experts transposed, `mlp.experts.gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H];
transformers' `save_pretrained` writes its modules' [E, 2I, H] and [E, H, I]. As
transformers' conversion mapping does, a tensor is transposed where its shape is not the
module's."""
from __future__ import annotations

from typing import Iterable

import torch

from tllm.layers.moe import SparseMoeBlock
from tllm.layers.quant import QuantConfig
from tllm.models.mixtral import MixtralForCausalLM
from tllm.models.qwen2_moe import routed_expert_args
from tllm.models.qwen3_moe import Qwen3MoeDecoderLayer
from tllm.models.qwen3_vl import Qwen3VLAttention, Qwen3VLForConditionalGeneration
from tllm.models.registry import register_model

_STACKED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


class Qwen3VLMoeDecoderLayer(Qwen3MoeDecoderLayer):
    attention_cls = Qwen3VLAttention

    def sparse_block(self, config, quant_config: QuantConfig | None, prefix: str):
        return SparseMoeBlock(**{**routed_expert_args(config), "renormalize": True},
                              quant_config=quant_config, prefix=prefix)


@register_model("Qwen3VLMoeForConditionalGeneration")
class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration, MixtralForCausalLM):
    """Qwen3-VL's images and forward; Mixtral's expert loading (next in line after the
    Qwen2.5-VL loader, which hands it the language model's tensors)."""
    layer_cls = Qwen3VLMoeDecoderLayer

    @staticmethod
    def make_vision_tower(vision_config):
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeVisionModel)
        return Qwen3VLMoeVisionModel(vision_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        hidden, inter = self.config.hidden_size, self.config.moe_intermediate_size
        module_shapes = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}

        def module_layout():
            for name, tensor in weights:
                if name.endswith(_STACKED_EXPERTS) and (
                        tuple(tensor.shape[1:]) != module_shapes[name.rsplit(".", 1)[1]]):
                    tensor = tensor.transpose(1, 2)
                yield name, tensor
        return super().load_weights(module_layout())
