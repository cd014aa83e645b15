"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): transformers' SigLIP vision tower
and Gemma 3 projector (patch features average-pooled to `mm_tokens_per_image` tokens, normed
and projected; transformers' modules: they run once per image) in place of the prompt's
image soft tokens; the decoder is our Gemma 3. Each `<start_of_image>` of the prompt text
becomes "\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n", as Gemma3Processor
writes it. The tokens of one image attend to each other both ways in prefill
(`bidirectional_images`: the runner gives each image token its image's last position as its
attention limit); decode is causal. Pan-and-scan (the image processor's do_pan_and_scan):
an image's crops are more images of the prompt, written out after it as Gemma3Processor
writes them ("Here is the original image ... and here are some crops ...")."""
from __future__ import annotations

from typing import Iterable

import torch

from tllm.models.gemma3 import Gemma3ForCausalLM
from tllm.models.registry import register_model
from tllm.models.vision_language import build_vision_tower, load_vision_language_weights


@register_model("Gemma3ForConditionalGeneration")
class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Built from the composite HF config; `self.config` is its text config."""
    is_multimodal = True
    bidirectional_images = True

    def __init__(self, config, backend_cls, max_position: int, quant_config=None) -> None:
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
        text = config.get_text_config()
        text.tie_word_embeddings = config.tie_word_embeddings
        super().__init__(text, backend_cls, max_position, quant_config)
        self.hf_config = config
        self.vision_tower = build_vision_tower(config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    # ---- images ----

    def encode(self, items) -> list[torch.Tensor]:
        """Each image's pooled, projected features [mm_tokens_per_image, hidden]."""
        pixels = torch.cat([item.data["pixel_values"] for item in items]).to(
            self.embed_tokens.weight.device, self.vision_tower.dtype)
        features = self.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state
        return list(self.multi_modal_projector(features))

    @staticmethod
    def split_items(processed: dict, hf_config) -> list[tuple[dict, int]]:
        """One (pixel_values [1, 3, H, W], mm_tokens_per_image) per image and per crop, in
        the image processor's order (each image, then its crops)."""
        count = int(hf_config.mm_tokens_per_image)
        return [({"pixel_values": p[None]}, count) for p in processed["pixel_values"]]

    @staticmethod
    def prompt_text(text: str, hf_config, tokenizer, processed: dict | None = None) -> str:
        """The prompt with each <start_of_image> written out as Gemma3Processor does,
        with one soft token an image (the processor repeats it): the i-th image's crops
        (`processed["num_crops"]`; none before the images are processed) follow it."""
        boi, eoi, soft = tokenizer.hf.convert_ids_to_tokens(
            [hf_config.boi_token_id, hf_config.eoi_token_id, hf_config.image_token_id])
        image = f"\n\n{boi}{soft}{eoi}\n\n"
        pieces = text.split(boi)
        crops = _num_crops(processed)
        crops += [0] * (len(pieces) - 1 - len(crops))
        return pieces[0] + "".join(_with_crops(image, n) + piece
                                   for n, piece in zip(crops, pieces[1:]))

    # ---- weights ----

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Either checkpoint layout (see load_vision_language_weights)."""
        return load_vision_language_weights(self, weights, super().load_weights)


def _num_crops(processed: dict | None) -> list[int]:
    crops = None if processed is None else processed.get("num_crops")
    return [] if crops is None else [int(n) for n in torch.as_tensor(crops).flatten()]


def _with_crops(image: str, num_crops: int) -> str:
    """An image's text, and its crops' after it (Gemma3Processor's layout)."""
    if not num_crops:
        return image
    return (f"Here is the original image {image} and here are some crops to help you see "
            "better " + " ".join([image] * num_crops))
