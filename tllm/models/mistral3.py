"""Mistral 3 with images (`Mistral3ForConditionalGeneration`: Mistral-Small-3.1): transformers'
Pixtral vision tower (2D rotary patches, any image size up to the processor's longest edge)
and Mistral 3 projector (RMS norm, a learned 2 x 2 patch merger, two linears); they run once
per image. The decoder is our Llama/Mistral (LLaVA's build and checkpoint names).

An image of R x C merged patches takes R rows of C `[IMG]` tokens, each row ending in
`[IMG_BREAK]` and the last in `[IMG_END]` (PixtralProcessor's layout). The whole layout is
the image's item, so its break and end positions get their tokens' own embeddings from
the encoder, as transformers leaves them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tllm.models.llava import LlavaForConditionalGeneration
from tllm.models.registry import register_model

# PixtralProcessor's defaults (the names Mistral's tokenizers use)
BREAK_TOKEN, END_TOKEN = "[IMG_BREAK]", "[IMG_END]"


def merged_patch_size(hf_config) -> int:
    """The pixels one image token covers along a side."""
    return int(hf_config.vision_config.patch_size) * int(hf_config.spatial_merge_size)


@register_model("Mistral3ForConditionalGeneration")
class Mistral3ForConditionalGeneration(LlavaForConditionalGeneration):
    """Built from the composite HF config; `self.config` is its text config."""

    @staticmethod
    def make_projector(config) -> torch.nn.Module:
        from transformers.models.mistral3.modeling_mistral3 import (
            Mistral3MultiModalProjector)
        return Mistral3MultiModalProjector(config)

    # ---- images ----

    def encode(self, items) -> list[torch.Tensor]:
        """Each image's layout embeddings [R * (C + 1), hidden]: the projected features at
        its [IMG] tokens, the break and end tokens' embeddings elsewhere. The images run
        through the tower together (it attends within each image)."""
        device, dtype = self.embed_tokens.weight.device, self.vision_tower.dtype
        sizes = torch.cat([item.data["image_sizes"] for item in items])
        height, width = sizes.max(0).values.tolist()
        pixels = torch.cat([F.pad(item.data["pixel_values"],
                                  (0, width - item.data["pixel_values"].shape[-1],
                                   0, height - item.data["pixel_values"].shape[-2]))
                            for item in items]).to(device, dtype)
        out = self.vision_tower(pixels, image_sizes=sizes, output_hidden_states=True,
                                return_dict=True)
        features = out.hidden_states[self.hf_config.vision_feature_layer].squeeze(0)
        merged = self.multi_modal_projector(features, sizes)
        counts = (sizes // merged_patch_size(self.hf_config)).prod(-1).tolist()
        embeds = []
        for item, image in zip(items, merged.split(counts)):
            token_ids = item.data["token_ids"].to(device)
            layout = self.embed(token_ids)
            layout[token_ids == self.hf_config.image_token_id] = image.to(layout.dtype)
            embeds.append(layout)
        return embeds

    @staticmethod
    def image_processor_kwargs(hf_config) -> dict:
        """PixtralProcessor resizes to multiples of the merged patch size."""
        side = merged_patch_size(hf_config)
        return {"patch_size": {"height": side, "width": side}}

    @staticmethod
    def split_items(processed: dict, hf_config) -> list[tuple[dict, int]]:
        """One (pixel_values [1, 3, h, w] without the batch's padding, image_sizes [1, 2],
        layout length) per image."""
        side = merged_patch_size(hf_config)
        parts = []
        for pixels, (height, width) in zip(processed["pixel_values"],
                                           processed["image_sizes"].tolist()):
            data = {"pixel_values": pixels[None, :, :height, :width].contiguous(),
                    "image_sizes": torch.tensor([[height, width]])}
            parts.append((data, (height // side) * (width // side + 1)))
        return parts

    @staticmethod
    def placeholder_layout(data: dict, hf_config, tokenizer) -> tuple[dict, list[int]]:
        """The image's data with its layout's token ids (`token_ids`: the encoder embeds
        the break and end tokens), and those ids."""
        ids = tokenizer.hf.convert_tokens_to_ids([BREAK_TOKEN, END_TOKEN])
        if None in ids or tokenizer.hf.unk_token_id in ids:
            raise ValueError(f"the tokenizer has no {BREAK_TOKEN} or {END_TOKEN} token")
        image_break, image_end = ids
        side = merged_patch_size(hf_config)
        height, width = data["image_sizes"][0].tolist()
        row = [int(hf_config.image_token_id)] * (width // side) + [image_break]
        layout = row * (height // side)
        layout[-1] = image_end
        return {**data, "token_ids": torch.tensor(layout)}, layout
