"""What a request with images carries through the loop: each image's encoder input, where
its placeholder tokens sit in the prompt, and its content hash (the encoder cache's key and
part of the prefix-cache key of the blocks it covers). Plain data, no engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass(eq=False)
class MultimodalItem:
    """One image: the encoder's inputs (e.g. pixel_values, image_grid_thw), and the
    `length` placeholder tokens from prompt position `offset` its embeddings replace."""
    modality: str
    content_hash: str
    offset: int
    length: int
    data: dict[str, torch.Tensor]

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(eq=False)
class MultimodalInputs:
    """A prompt's images, in prompt order; with M-RoPE (Qwen2.5-VL), the prompt's
    positions [3, num_prompt_tokens] and the shift of every later token's position.
    `whole_items`: the model's image tokens attend to each other both ways (Gemma 3), so a
    prefill chunk should not cut through an image."""
    items: list[MultimodalItem] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0
    whole_items: bool = False

    def chunk_end(self, start: int, end: int) -> int:
        """A prefill chunk start:end's end, moved back to the start of an image it would cut
        when `whole_items` (an image that starts the chunk and is longer is cut)."""
        if self.whole_items:
            for item in self.items:
                if start < item.offset < end < item.end:
                    return item.offset
        return end

    def hashes_in(self, start: int, end: int) -> tuple[str, ...]:
        """The hashes of the items whose placeholders overlap prompt positions start:end."""
        return tuple(item.content_hash for item in self.items
                     if item.offset < end and item.end > start)
