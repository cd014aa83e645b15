"""Qwen3-VL (dense): the Qwen3 decoder (per-head q/k norms) with interleaved M-RoPE, and
transformers' Qwen3-VL vision tower (Qwen3VLVisionModel: it runs once per image, so its
speed matters less than the decoder's) whose merged patch embeddings replace the prompt's
image placeholder tokens.

DeepStack: the tower also merges the outputs of a few of its layers
(`deepstack_visual_indexes`); the k-th of those is added to the hidden states after decoder
layer k, at the image's token positions (transformers' Qwen3VLTextModel._deepstack_process).
`encode` returns each image's rows as [main | deepstack_0 | ... ] side by side, so the
encoder cache keeps them together and a prefill chunk that cuts through an image gets the
same rows of all of them; the forward splits them again.

Positions are Qwen2.5-VL's (transformers' get_rope_index gives the same for images), and
so are the processor's outputs (Qwen2VLImageProcessor, patch 16), the placeholder
expansion and the checkpoint names."""
from __future__ import annotations

import torch

from tllm.attention.interface import AttentionMetadata, KVCache
from tllm.layers.rotary import RotaryEmbedding, position_inverse_frequencies
from tllm.models.llama import head_dim_of
from tllm.models.qwen2 import Qwen2DecoderLayer
from tllm.models.qwen2_5_vl import (MRotaryEmbedding, Qwen2_5_VLAttention,
                                   Qwen2_5_VLForConditionalGeneration)
from tllm.models.registry import register_model

DEFAULT_MROPE_SECTION = [24, 20, 20]


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """Qwen3-VL's M-RoPE: frequencies interleaved (t, h, w, t, h, w, ...) instead of in
    three blocks: frequency j rotates by the height position when j % 3 == 1 and
    j < 3 * mrope_section[1], by the width position when j % 3 == 2 and
    j < 3 * mrope_section[2], by the temporal one otherwise."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_position: int,
                 mrope_section: list[int]) -> None:
        super().__init__(inv_freq, attention_scaling, max_position, mrope_section)
        j = torch.arange(self.rotary_dim // 2)
        section = torch.zeros_like(j)
        section[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
        section[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
        self.section_of_dim.copy_(torch.cat((section, section)))


class Qwen3VLAttention(Qwen2_5_VLAttention):
    qkv_bias = False   # the config's attention_bias decides
    qk_norm = True


class Qwen3VLDecoderLayer(Qwen2DecoderLayer):
    attention_cls = Qwen3VLAttention


@register_model("Qwen3VLForConditionalGeneration")
class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Built from the composite HF config; `self.config` is its text config. Runs on one
    rank (as the other vision-language models): the DeepStack rows reach the first stage
    only."""
    layer_cls = Qwen3VLDecoderLayer

    @staticmethod
    def make_vision_tower(vision_config):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
        return Qwen3VLVisionModel(vision_config)

    def make_rotary(self, kind: str | None, max_position: int) -> RotaryEmbedding:
        inv_freq, scaling = position_inverse_frequencies(self.config, head_dim_of(self.config),
                                                         max_position)
        section = self.config.rope_parameters.get("mrope_section", DEFAULT_MROPE_SECTION)
        return InterleavedMRotaryEmbedding(inv_freq.to(torch.get_default_device()), scaling,
                                           max_position, list(section))

    def encode(self, items) -> list[torch.Tensor]:
        """Each item's rows [length, hidden * (1 + number of DeepStack layers)]: the merged
        embeddings, then each DeepStack merger's, side by side."""
        device = self.embed_tokens.weight.device
        pixels = torch.cat([item.data["pixel_values"] for item in items]).to(
            device, self.visual.dtype)
        grids = torch.cat([item.data["image_grid_thw"] for item in items]).to(device)
        out = self.visual(pixels, grid_thw=grids, return_dict=True)
        rows = torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
        return list(rows.split([item.length for item in items]))

    def forward(self, input_ids: torch.Tensor | None, kv_caches: list[KVCache],
                metadata: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None):
        """As the Llama forward, with the image rows' DeepStack features added after the
        first layers (a layer's output is hidden + residual: adding to either is the
        same)."""
        deepstack: list[torch.Tensor] = []
        if self.is_first_stage:
            hidden, residual = self.embed(input_ids), None
            if mm_embeds is not None:
                rows, embeds = mm_embeds
                main, *deepstack = embeds.to(hidden.dtype).split(self.config.hidden_size, 1)
                hidden = hidden.index_copy(0, rows, main)
        else:
            hidden, residual = intermediate
        for i, kv_cache in zip(self.stage_layers, kv_caches):
            hidden, residual = self.layers[i](hidden, residual, kv_cache,
                                              metadata.for_layer(i))
            if i < len(deepstack):
                hidden = hidden.index_add(0, rows, deepstack[i])
        if not self.is_last_stage:
            return hidden, residual if residual is not None else torch.zeros_like(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden
