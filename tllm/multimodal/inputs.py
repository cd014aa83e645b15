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
    positions [3, num_prompt_tokens] and the shift of every later token's position."""
    items: list[MultimodalItem] = field(default_factory=list)
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0

    def hashes_in(self, start: int, end: int) -> tuple[str, ...]:
        """The hashes of the items whose placeholders overlap prompt positions start:end."""
        return tuple(item.content_hash for item in self.items
                     if item.offset < end and item.end > start)
