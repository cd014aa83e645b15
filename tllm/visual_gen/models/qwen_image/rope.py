"""Qwen-Image's 3D RoPE as cos/sin tables, cached per shape.

Each image token has a (frame, row, column) position; with `scale_rope` (always on in
Qwen-Image) rows and columns are centred, running from -(h - h // 2) to h // 2 - 1. Text token
i sits at position start + i on all three axes, where start is one past the largest image
half-extent, so text never shares a position with the image. Frames: in the plain variant,
image j of a sample (an edit's reference images) is frame j; in the layered variant
(Qwen-Image-Layered) the generated layers are frames 0.. and the last image, the condition, is
frame -1, and text starts past the layer count too. Text positions cover the padded text
length, as diffusers' do, so a right-padded row gets the same positions as the row alone.

Angles match diffusers' `QwenEmbedRope`/`QwenEmbedLayer3DRope` (float32 position x inverse
frequency); the tables hold one (cos, sin) per rotated pair, [tokens, head_dim // 2]."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

ImageShapes = tuple[tuple[int, int, int], ...]  # one sample's (frames, rows, columns) per image

_CACHE_SIZE = 16


@dataclass(frozen=True)
class RopeTables:
    """float32 cos/sin per rotated pair: image tokens [N, D/2], text tokens [L, D/2]."""
    img_cos: torch.Tensor
    img_sin: torch.Tensor
    txt_cos: torch.Tensor
    txt_sin: torch.Tensor


class QwenRope:
    """Builds and caches `RopeTables` for (image shapes, text length, device)."""

    def __init__(self, axes_dims: tuple[int, int, int], theta: float = 10000,
                 layered: bool = False) -> None:
        if any(d % 2 for d in axes_dims):
            raise ValueError(f"axes_dims_rope must be even, got {axes_dims}")
        self.axes_dims = tuple(axes_dims)
        self.layered = layered
        # built on the host (also when the model is constructed under a meta device)
        self._inv_freqs = [
            1.0 / torch.pow(theta, torch.arange(0, d, 2, device="cpu").float().div(d))
            for d in axes_dims]
        self._cache: OrderedDict[tuple, RopeTables] = OrderedDict()

    def tables(self, shapes: ImageShapes, txt_len: int, device: torch.device) -> RopeTables:
        key = (shapes, txt_len, str(device))
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        img = self._angles(*self._image_positions(shapes))
        txt_pos = torch.arange(txt_len, device="cpu") + self._text_start(shapes)
        txt = self._angles(txt_pos, txt_pos, txt_pos)
        tables = RopeTables(img.cos().to(device), img.sin().to(device),
                            txt.cos().to(device), txt.sin().to(device))
        self._cache[key] = tables
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return tables

    def _image_positions(self, shapes: ImageShapes):
        """Per-token (frame, row, column) positions of all images, in token order."""
        frames, rows, cols = [], [], []
        for index, (f, h, w) in enumerate(shapes):
            is_condition = self.layered and index == len(shapes) - 1
            if is_condition and f != 1:
                raise ValueError(f"the layered condition image must have one frame, got {f}")
            frame = (torch.full((f,), -1, device="cpu") if is_condition
                     else torch.arange(index, index + f, device="cpu"))
            grid = torch.meshgrid(frame, torch.arange(h, device="cpu") - (h - h // 2),
                                  torch.arange(w, device="cpu") - (w - w // 2), indexing="ij")
            for out, axis in zip((frames, rows, cols), grid):
                out.append(axis.reshape(-1))
        return torch.cat(frames), torch.cat(rows), torch.cat(cols)

    def _text_start(self, shapes: ImageShapes) -> int:
        start = max(max(h // 2, w // 2) for _, h, w in shapes)
        return max(start, len(shapes) - 1) if self.layered else start

    def _angles(self, frame, row, col) -> torch.Tensor:
        return torch.cat([pos.float()[:, None] * inv[None, :]
                          for pos, inv in zip((frame, row, col), self._inv_freqs)], dim=1)
