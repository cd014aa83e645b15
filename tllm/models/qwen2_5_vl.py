"""Qwen2.5-VL: the Qwen2 decoder with M-RoPE (each token rotates by three positions,
temporal, height and width, over three sections of its frequencies) and a vision tower
whose merged patch embeddings replace the prompt's image placeholder tokens.

The vision tower is transformers' module (Qwen2_5_VisionTransformerPretrainedModel,
window attention included): it runs once per image (the runner's encoder cache), so its
speed matters less than the decoder's. The decoder is ours."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from tllm.attention.interface import KVCache, AttentionMetadata
from tllm.layers.rotary import RotaryEmbedding, position_inverse_frequencies, step_cached
from tllm.layers.linear import _copy_checked
from tllm.models.llama import head_dim_of
from tllm.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM
from tllm.models.registry import register_model


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary tables as RotaryEmbedding's, read at positions [3, T]: frequency j of a head
    rotates by the position of the section `mrope_section` puts it in."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_position: int,
                 mrope_section: list[int]) -> None:
        super().__init__(inv_freq, attention_scaling, max_position)
        half = self.rotary_dim // 2
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {mrope_section} must add up to {half} "
                             "(head_dim / 2)")
        section = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("section_of_dim", torch.cat((section, section)), persistent=False)

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and [-sin, sin] at positions [3, T] (temporal, height, width), each
        dimension read at its section's position; gathered once per step (step_cached)."""
        def gather():
            dims = torch.arange(self.rotary_dim, device=positions.device)
            rows = positions[self.section_of_dim]               # [D, T]
            cos = self.cos[rows, dims[:, None]].T.to(dtype).unsqueeze(1)
            sin = self.sin[rows, dims[:, None]].T.to(dtype).unsqueeze(1)
            half = self.rotary_dim // 2
            return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return step_cached(self, positions, dtype, gather)


class Qwen2_5_VLAttention(Qwen2Attention):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               metadata: AttentionMetadata) -> torch.Tensor:
        """Rotated by the step's M-RoPE positions (after the q/k norms of a model that has
        them: Qwen3-VL), then attention without rope."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = metadata.mrope_positions
        if positions is None:  # a step built without them: text, unshifted
            positions = metadata.positions.expand(3, -1)
        q, k = self.rotary(positions, q, k)
        out = self.attn.forward(q, k, v, kv_cache, metadata, self.kv_scales)
        return self.o_proj(out.flatten(1))


class Qwen2_5_VLDecoderLayer(Qwen2DecoderLayer):
    attention_cls = Qwen2_5_VLAttention


@register_model("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    """Built from the composite HF config; `self.config` is its text config."""
    layer_cls = Qwen2_5_VLDecoderLayer
    is_multimodal = True
    uses_mrope = True

    def __init__(self, config, backend_cls, max_position: int, quant_config=None) -> None:
        text = config.get_text_config()
        text.tie_word_embeddings = config.tie_word_embeddings
        super().__init__(text, backend_cls, max_position, quant_config)
        self.hf_config = config
        vision = config.vision_config
        vision._attn_implementation = "sdpa"
        self.visual = self.make_vision_tower(vision)
        self.spatial_merge_size = vision.spatial_merge_size

    @staticmethod
    def make_vision_tower(vision_config):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel)
        return Qwen2_5_VisionTransformerPretrainedModel(vision_config)

    def make_rotary(self, kind: str | None, max_position: int) -> RotaryEmbedding:
        inv_freq, scaling = position_inverse_frequencies(self.config, head_dim_of(self.config),
                                                         max_position)
        section = self.config.rope_parameters.get("mrope_section", [16, 24, 24])
        return MRotaryEmbedding(inv_freq.to(torch.get_default_device()), scaling,
                                max_position, list(section))

    # ---- images ----

    def encode(self, items) -> list[torch.Tensor]:
        """Each item's embeddings [length, hidden], the items run through the tower at once
        (each image attends only within itself)."""
        device = self.embed_tokens.weight.device
        pixels = torch.cat([item.data["pixel_values"] for item in items]).to(
            device, self.visual.dtype)
        grids = torch.cat([item.data["image_grid_thw"] for item in items]).to(device)
        merged = self.visual(pixels, grid_thw=grids).pooler_output
        return list(merged.split([item.length for item in items]))

    @staticmethod
    def split_items(processed: dict, hf_config) -> list[tuple[dict, int]]:
        """The processor's batched output as one (encoder inputs, placeholder count) per
        image: pixel_values rows are each image's patches, grid t*h*w of them, merged
        merge_size^2 to a token."""
        merge = hf_config.vision_config.spatial_merge_size
        grids = processed["image_grid_thw"]
        sizes = grids.prod(-1).tolist()
        pixels = processed["pixel_values"].split(sizes)
        return [({"pixel_values": p, "image_grid_thw": g[None]}, n // merge ** 2)
                for p, g, n in zip(pixels, grids, sizes)]

    @staticmethod
    def prompt_positions(num_tokens: int, items, hf_config) -> tuple[np.ndarray, int]:
        """M-RoPE positions [3, num_tokens] of a prompt with these images, and the shift
        of every later position: text advances all three by one a token; an image's
        tokens take (t, row, column) of its merged grid from where the text stopped, and
        the text after it resumes past its larger side (HF's get_rope_index, for images)."""
        merge = hf_config.vision_config.spatial_merge_size
        columns, pos, cursor = [], 0, 0
        for item in items:
            t, h, w = item.data["image_grid_thw"][0].tolist()
            h, w = h // merge, w // merge
            text = item.offset - cursor
            columns.append(np.broadcast_to(np.arange(text) + pos, (3, text)))
            pos += text
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w),
                                        indexing="ij")).reshape(3, -1)
            columns.append(grid + pos)
            pos += max(h, w)
            cursor = item.end
        text = num_tokens - cursor
        columns.append(np.broadcast_to(np.arange(text) + pos, (3, text)))
        positions = np.concatenate(columns, axis=1).astype(np.int64)
        return positions, int(positions.max()) + 1 - num_tokens

    # ---- weights ----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names of either layout: transformers 5's (model.visual.*,
        model.language_model.*) or the hub's (visual.*, model.*)."""
        visual_params = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith("visual."):
                    leaf = name.removeprefix("visual.")
                    if leaf not in visual_params:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                         f"{type(self).__name__}")
                    _copy_checked(visual_params[leaf], tensor, name)
                    loaded.add(f"visual.{leaf}#None")
                    continue
                yield name.replace("language_model.", "", 1), tensor

        loaded |= super().load_weights(text_weights())
        return loaded
