"""A prompt with images made into what a request carries: transformers' image processor
from the model folder (AutoImageProcessor) gives the pixel values, the model class splits
them per image and says how many placeholder tokens each takes; each image's one
placeholder token in the tokenized prompt is repeated that many times (what transformers'
processors do to the text: the placeholder is a special token, so tokenizing is the same),
or replaced by the ids the model class lays out (`placeholder_layout`: Mistral 3's rows);
for M-RoPE the model class gives the prompt's positions; each image gets a content hash
(of its processed pixels). transformers' AutoProcessor is not used: for Qwen2.5-VL it
needs a video processor, which needs torchvision, even for images."""
from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import torch

from tllm.models.registry import get_model_class
from tllm.multimodal.inputs import MultimodalInputs, MultimodalItem
from tllm.multimodal.media import DEFAULT_MAX_IMAGE_PIXELS, MediaError, load_image


class MultimodalProcessor:
    """Turns (prompt text with one placeholder token per image, images) into (token ids,
    MultimodalInputs), refusing more than `max_images` images a prompt."""

    def __init__(self, image_processor, tokenizer, hf_config, max_images: int,
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer    # tllm's Tokenizer
        self.hf_config = hf_config
        self.model_cls = get_model_class(hf_config.architectures[0])
        self.image_token_id = _image_token_id(hf_config)
        self.max_images = max_images
        self.max_pixels = max_pixels

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, tokenizer, hf_config,
                        max_images: int) -> MultimodalProcessor:
        from transformers import AutoImageProcessor
        return cls(AutoImageProcessor.from_pretrained(os.fspath(path)), tokenizer, hf_config,
                   max_images)

    def process(self, text: str, images: Sequence[Any], param: str = "multi_modal_data",
                add_special_tokens: bool = True) -> tuple[list[int], MultimodalInputs]:
        """`add_special_tokens`: False for text a chat template rendered (it wrote them)."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        if len(images) > self.max_images:
            raise MediaError(f"{len(images)} images given; at most {self.max_images} a "
                             "prompt (limit_mm_per_prompt)", f"{param}.image")
        pil = [load_image(image, f"{param}.image[{i}]", self.max_pixels)
               for i, image in enumerate(images)]
        token_ids, offsets = self._placeholders(text, pil, add_special_tokens)
        if len(offsets) != len(pil):
            raise MediaError(f"the prompt has {len(offsets)} image placeholders for "
                             f"{len(pil)} images", param)
        if not pil:
            return token_ids, MultimodalInputs()
        # Mistral 3 resizes to its merged patch size, not the processor file's patch size
        options = getattr(self.model_cls, "image_processor_kwargs", lambda config: {})
        try:
            processed = self.image_processor(images=pil, return_tensors="pt",
                                             **options(self.hf_config))
        except (ValueError, TypeError, IndexError) as exc:
            raise MediaError(f"the image processor refused the images: {exc}", param) from None
        splits = self.model_cls.split_items(processed, self.hf_config)
        if len(splits) != len(pil):   # pan-and-scan crops: more images the text writes out
            token_ids, offsets = self._placeholders(text, pil, add_special_tokens, processed)
            if len(offsets) != len(splits):
                raise MediaError(f"the prompt has {len(offsets)} image placeholders for "
                                 f"{len(splits)} images and crops", param)
        parts = [(data, [self.image_token_id] * count) for data, count in splits]
        layout = getattr(self.model_cls, "placeholder_layout", None)
        if layout is not None:  # Mistral 3: rows of image tokens end in break tokens
            parts = [layout(data, self.hf_config, self.tokenizer) for data, _ in parts]
        token_ids, items = _expand(token_ids, offsets, parts)
        mm = MultimodalInputs(items,
                              whole_items=getattr(self.model_cls, "bidirectional_images", False))
        if getattr(self.model_cls, "uses_mrope", False):
            mm.mrope_positions, mm.mrope_delta = self.model_cls.prompt_positions(
                len(token_ids), items, self.hf_config)
        return token_ids, mm

    def _placeholders(self, text: str, pil: list, add_special_tokens: bool,
                      processed: dict | None = None) -> tuple[list[int], list[int]]:
        """The prompt's token ids and the offsets of its image placeholder tokens; a model
        that writes each image out around its token (Gemma 3) rewrites the text first,
        with the crops of `processed` once it has them."""
        rewrite = getattr(self.model_cls, "prompt_text", None)
        if rewrite is not None and pil:
            text = rewrite(text, self.hf_config, self.tokenizer, processed)
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return token_ids, [i for i, t in enumerate(token_ids) if t == self.image_token_id]


def _expand(token_ids: list[int], offsets: list[int], parts: list[tuple[dict, list[int]]]
            ) -> tuple[list[int], list[MultimodalItem]]:
    """Each image's placeholder replaced by its (data, placeholder ids)'s ids, one per
    embedding, and the items."""
    expanded: list[int] = []
    items = []
    previous = 0
    for offset, (data, placeholder_ids) in zip(offsets, parts):
        expanded.extend(token_ids[previous:offset])
        items.append(MultimodalItem("image", content_hash(data), len(expanded),
                                    len(placeholder_ids), data))
        expanded.extend(placeholder_ids)
        previous = offset + 1
    expanded.extend(token_ids[previous:])
    return expanded, items


def content_hash(data: dict[str, torch.Tensor]) -> str:
    """A hash of an item's encoder inputs (names, shapes, dtypes and values)."""
    digest = hashlib.sha256()
    for name in sorted(data):
        tensor = data[name].contiguous().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _image_token_id(hf_config) -> int:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{hf_config.architectures[0]}: the config names no image token id")
