"""LLaVA: a CLIP or SigLIP vision tower (transformers' module: it runs once per image), one
of its layers' patch features through a two-layer projector, in place of the prompt's
`<image>` placeholders; the decoder is our Llama (Llama, Mistral text configs)."""
from __future__ import annotations

from typing import Iterable

import torch

from tllm.layers.linear import _copy_checked
from tllm.models.llama import LlamaForCausalLM
from tllm.models.registry import register_model

TEXT_MODEL_TYPES = ("llama", "mistral")


@register_model("LlavaForConditionalGeneration")
class LlavaForConditionalGeneration(LlamaForCausalLM):
    """Built from the composite HF config; `self.config` is its text config."""
    is_multimodal = True

    def __init__(self, config, backend_cls, max_position: int, quant_config=None) -> None:
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        text = config.get_text_config()
        if text.model_type not in TEXT_MODEL_TYPES:
            raise ValueError(f"LLaVA with a {text.model_type!r} decoder is not supported "
                             f"(decoders: {', '.join(TEXT_MODEL_TYPES)})")
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError("LLaVA with several vision feature layers is not supported")
        text.tie_word_embeddings = config.tie_word_embeddings
        super().__init__(text, backend_cls, max_position, quant_config)
        self.hf_config = config
        config.vision_config._attn_implementation = "sdpa"
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)

    # ---- images ----

    def encode(self, items) -> list[torch.Tensor]:
        """Each image's projected patch features [length, hidden], all images at once."""
        config = self.hf_config
        pixels = torch.cat([item.data["pixel_values"] for item in items]).to(
            self.embed_tokens.weight.device, self.vision_tower.dtype)
        out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        features = out.hidden_states[config.vision_feature_layer]
        if config.vision_feature_select_strategy == "default":
            features = features[:, 1:]    # the CLS token's
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
        """Checkpoint names of either layout: transformers 5's (model.vision_tower.*,
        model.multi_modal_projector.*, model.language_model.*) or the older one
        (vision_tower.*, multi_modal_projector.*, language_model.model.*,
        language_model.lm_head.*)."""
        tower = {f"vision_tower.{n}": p for n, p in self.vision_tower.named_parameters()}
        tower.update({f"multi_modal_projector.{n}": p
                      for n, p in self.multi_modal_projector.named_parameters()})
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith(("vision_tower.", "multi_modal_projector.")):
                    if name not in tower:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                         f"{type(self).__name__}")
                    _copy_checked(tower[name], tensor, name)
                    loaded.add(f"{name}#None")
                    continue
                name = name.removeprefix("language_model.").removeprefix("model.")
                yield name, tensor

        loaded |= super().load_weights(text_weights())
        return loaded
