"""LLaVA: a CLIP or SigLIP vision tower (transformers' module: it runs once per image), one
of its layers' patch features through a two-layer projector, in place of the prompt's
`<image>` placeholders; the decoder is our Llama (Llama, Mistral text configs)."""
from __future__ import annotations

from typing import Iterable

import torch

from tllm.models.llama import LlamaForCausalLM
from tllm.models.registry import register_model
from tllm.models.vision_language import (build_vision_tower, load_vision_language_weights,
                                         tower_features)


@register_model("LlavaForConditionalGeneration")
class LlavaForConditionalGeneration(LlamaForCausalLM):
    """Built from the composite HF config; `self.config` is its text config."""
    is_multimodal = True
    text_model_types = ("llama", "mistral")

    def __init__(self, config, backend_cls, max_position: int, quant_config=None) -> None:
        text = config.get_text_config()
        if text.model_type not in self.text_model_types:
            raise ValueError(f"{type(self).__name__} with a {text.model_type!r} decoder is not "
                             f"supported (decoders: {', '.join(self.text_model_types)})")
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError(f"{type(self).__name__} with several vision feature layers is "
                             "not supported")
        text.tie_word_embeddings = config.tie_word_embeddings
        super().__init__(text, backend_cls, max_position, quant_config)
        self.hf_config = config
        self.vision_tower = build_vision_tower(config)
        self.multi_modal_projector = self.make_projector(config)

    @staticmethod
    def make_projector(config) -> torch.nn.Module:
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        return LlavaMultiModalProjector(config)

    # ---- images ----

    def encode(self, items) -> list[torch.Tensor]:
        """Each image's projected patch features [length, hidden], all images at once."""
        pixels = torch.cat([item.data["pixel_values"] for item in items]).to(
            self.embed_tokens.weight.device, self.vision_tower.dtype)
        features = tower_features(self.vision_tower, pixels, self.hf_config)
        return list(self.multi_modal_projector(features))

    @staticmethod
    def split_items(processed: dict, hf_config) -> list[tuple[dict, int]]:
        """One (pixel_values [1, 3, H, W], placeholder count) per image: its patches, and
        the CLS token under the "full" strategy."""
        vision = hf_config.vision_config
        pixels = processed["pixel_values"]
        count = (pixels.shape[-2] // vision.patch_size) * (pixels.shape[-1] // vision.patch_size)
        if hf_config.vision_feature_select_strategy == "full":
            count += 1
        return [({"pixel_values": p[None]}, count) for p in pixels]

    # ---- weights ----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Either checkpoint layout (see load_vision_language_weights)."""
        return load_vision_language_weights(self, weights, super().load_weights)
