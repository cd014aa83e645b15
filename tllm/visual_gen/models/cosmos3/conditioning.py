"""The conditioning frame of image-to-video: resized to cover the output size (aspect kept,
bilinear with antialiasing), centre-cropped, and scaled to [-1, 1], as Cosmos 3's pipeline
prepares it."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def preprocess_image(image, height: int, width: int) -> torch.Tensor:
    """A PIL image, HWC uint8 array or CHW tensor -> [1, 3, height, width] float32 in [-1, 1]."""
    pixels = _as_tensor(image)
    if pixels.dim() != 4 or pixels.shape[:2] != (1, 3):
        raise ValueError(f"image must be one RGB image, got shape {tuple(pixels.shape)}")
    is_integer = not pixels.is_floating_point()
    pixels = pixels.float()
    if not is_integer:      # floats in [-1, 1] or [0, 1]: to the 0..255 range
        if pixels.min() < 0:
            pixels = (pixels + 1.0) * 127.5
        elif pixels.max() <= 1.0:
            pixels = pixels * 255.0
    src_h, src_w = pixels.shape[-2:]
    scale = max(width / src_w, height / src_h)
    size = (math.ceil(scale * src_h), math.ceil(scale * src_w))
    pixels = F.interpolate(pixels, size=size, mode="bilinear", align_corners=False,
                           antialias=True)
    top, left = round((size[0] - height) / 2), round((size[1] - width) / 2)
    pixels = pixels[:, :, top:top + height, left:left + width]
    return pixels.round().clamp(0, 255) / 127.5 - 1.0


def _as_tensor(image) -> torch.Tensor:
    if isinstance(image, torch.Tensor):
        return image.unsqueeze(0) if image.dim() == 3 else image
    if isinstance(image, np.ndarray):
        array = torch.from_numpy(image)
    else:       # PIL
        array = torch.from_numpy(np.array(image.convert("RGB"), copy=True))
    array = array.unsqueeze(0) if array.dim() == 3 else array
    return array.permute(0, 3, 1, 2)
