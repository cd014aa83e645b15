"""LTX-2's image-to-video conditioning: the input image re-compressed as one H.264 frame at
the CRF LTX-2 was trained with (diffusers' `apply_image_conditioning_crf`, PyAV), resized to
the output size (bilinear) and scaled to [-1, 1] by diffusers' VideoProcessor, as
LTX2ImageToVideoPipeline prepares it; and the loop hook that keeps the first frame clean."""
from __future__ import annotations

import numpy as np
import torch

from tllm.visual_gen.pipeline import DenoiseHook, DenoiseStep

IMAGE_CRF = 33      # LTX-2.0 to 2.3 (Gemma 3 text encoders)


def preprocess_image(image, height: int, width: int, vae_scale: int) -> torch.Tensor:
    """A PIL image or HWC uint8 array -> [1, 3, height, width] float32 in [-1, 1]."""
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
    from diffusers.video_processor import VideoProcessor
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] not in (3, 4):
            raise ValueError("image: an array must be (H, W, 3) uint8")
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise ValueError(f"image must be a PIL image or a uint8 array, got {type(image)}")
    image = Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")),
                                                         IMAGE_CRF))
    processor = VideoProcessor(vae_scale_factor=vae_scale, resample="bilinear")
    return processor.preprocess(image, height=height, width=width).float()


class KeepCleanTokens(DenoiseHook):
    """Puts a stream's leading tokens back after every scheduler step (the conditioning frame:
    diffusers steps only the frames after it; the step is elementwise, so this is the same)."""

    def __init__(self, stream: str, clean: torch.Tensor) -> None:
        self.stream, self.clean = stream, clean.clone()

    def update(self, step: DenoiseStep) -> None:
        latents = step.streams[self.stream].clone()
        latents[:, :self.clean.shape[1]] = self.clean
        step.streams = {**step.streams, self.stream: latents}
