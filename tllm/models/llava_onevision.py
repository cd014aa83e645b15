"""LLaVA-OneVision with images (`LlavaOnevisionForConditionalGeneration`): LLaVA's build
(transformers' SigLIP tower and two-layer projector; they run once per image) with our Qwen2
decoder. "anyres": the image processor cuts an image into tiles of the tower's size on the
best grid of `image_grid_pinpoints`, after a base tile of the whole image; the tiles'
features are stitched into one grid, the padding cropped, pooled down past
`anyres_max_N` tiles' worth, and each row ended by the learned `image_newline`
(transformers' packing, LlavaOnevisionModel.pack_image_features). The prompt's `<image>` is
repeated to the packed length. Videos are not supported."""
from __future__ import annotations

from types import SimpleNamespace
import torch
from torch import nn

from tllm.models.llava import LlavaForConditionalGeneration
from tllm.models.qwen2 import Qwen2DecoderLayer
from tllm.models.registry import register_model
from tllm.models.vision_language import load_vision_language_weights, tower_features


def pack_image(tiles: torch.Tensor, image_size: torch.Tensor, newline: torch.Tensor,
               hf_config) -> torch.Tensor:
    """An image's tile features [tiles, patches, hidden] packed as transformers packs them
    ([length, hidden]); its packing reads nothing of the model but the config."""
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionModel)
    owner = SimpleNamespace(config=hf_config)
    packed, _ = LlavaOnevisionModel.pack_image_features(
        owner, [tiles], image_size.reshape(1, 2), image_newline=newline,
        vision_aspect_ratio=hf_config.vision_aspect_ratio)
    return packed[0]


@register_model("LlavaOnevisionForConditionalGeneration")
class LlavaOnevisionForConditionalGeneration(LlavaForConditionalGeneration):
    """Built from the composite HF config; `self.config` is its text config."""
    text_model_types = ("qwen2",)
    layer_cls = Qwen2DecoderLayer

    def __init__(self, config, backend_cls, max_position: int, quant_config=None) -> None:
        if config.vision_feature_select_strategy != "full":
            # transformers' processor and model disagree on the token count then
            raise ValueError("LLaVA-OneVision needs vision_feature_select_strategy 'full', "
                             f"got {config.vision_feature_select_strategy!r}")
        super().__init__(config, backend_cls, max_position, quant_config)
        self.image_newline = nn.Parameter(torch.zeros(self.config.hidden_size))

    @staticmethod
    def make_projector(config) -> nn.Module:
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            LlavaOnevisionMultiModalProjector)
        return LlavaOnevisionMultiModalProjector(config)

    # ---- images ----

    def encode(self, items) -> list[torch.Tensor]:
        """Each image's packed features [length, hidden]; all tiles through the tower at
        once."""
        pixels = torch.cat([item.data["pixel_values"] for item in items]).to(
            self.embed_tokens.weight.device, self.vision_tower.dtype)
        features = self.multi_modal_projector(
            tower_features(self.vision_tower, pixels, self.hf_config))
        tiles = features.split([len(item.data["pixel_values"]) for item in items])
        return [pack_image(image, item.data["image_sizes"], self.image_newline, self.hf_config)
                for image, item in zip(tiles, items)]

    @staticmethod
    def split_items(processed: dict, hf_config) -> list[tuple[dict, int]]:
        """One (pixel_values [tiles, 3, S, S] without the batch's padding tiles,
        image_sizes [1, 2], packed length) per image. The image processor tiles an image
        alone in its batch entry (all of a flat list, as the prompt's images come) and
        keeps only the base tile of one of several."""
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            image_size_to_num_patches)
        vision = hf_config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        counts = processed.get("batch_num_images", [1] * len(processed["pixel_values"]))
        tiled = [n == 1 for n in torch.as_tensor(counts).tolist() for _ in range(n)]
        parts = []
        for pixels, size, is_tiled in zip(processed["pixel_values"], processed["image_sizes"],
                                          tiled):
            count = (image_size_to_num_patches(size, hf_config.image_grid_pinpoints,
                                               vision.image_size) if is_tiled else 1)
            data = {"pixel_values": pixels[:count].contiguous(), "image_sizes": size[None]}
            shape_only = torch.zeros(count, patches, 1)
            length = len(pack_image(shape_only, size, torch.zeros(1), hf_config))
            parts.append((data, length))
        return parts
