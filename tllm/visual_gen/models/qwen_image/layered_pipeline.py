"""Qwen-Image-Layered: an input image decomposed into RGBA layers, guided by its caption
(written by the text encoder when the prompt is left empty).

The transformer denoises layers + 1 frames (the first is the recomposed image, dropped at the
end) next to the input image's VAE latents, which condition every step and are not denoised.
Numerics follow diffusers' QwenImageLayeredPipeline (size buckets, schedule, noise).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from tllm.visual_gen.models.qwen_image.pipeline import (QwenImagePipeline, pack_latents,
                                                        unpack_latents)
from tllm.visual_gen.params import VisualGenParams, check
from tllm.visual_gen.pipeline import (DenoiseHook, ModelInputs, VisualGenOutput, image_seeds,
                                      initial_noise, to_pil)

DEFAULT_LAYERS = 4
DEFAULT_RESOLUTION = 640
_BASE_SEQ_LEN = 256 * 256 / 16 / 16     # the condition's token count at which mu is 1
_BUCKET_MULTIPLE = 32


class QwenImageLayeredPipeline(QwenImagePipeline):
    """Qwen-Image-Layered: (caption, image) to `layers` RGBA images per seed."""

    max_prompt_tokens = None
    cfg_normalize = False
    takes_image = True

    @torch.no_grad()
    def generate(self, prompts: list[str], params: VisualGenParams,
                 images: Sequence[Any] | None = None,
                 hooks: Sequence[DenoiseHook] = ()) -> VisualGenOutput:
        self.check_request(params, images, prompts)
        num_layers = params.layers or DEFAULT_LAYERS
        per_prompt = params.num_images_per_prompt
        cond_h, cond_w = self.bucket(images, params.resolution or DEFAULT_RESOLUTION)
        height, width = (cond_h // self.size_multiple * self.size_multiple,
                         cond_w // self.size_multiple * self.size_multiple)
        resized = [image.resize((cond_w, cond_h), resample=_lanczos()) for image in images]
        prompts = self.fill_captions(prompts, resized, params.caption_language)
        condition = self.encode_images(resized)                          # (1 or P, S', C)
        condition = condition.repeat_interleave(
            per_prompt * (len(prompts) if len(condition) == 1 else 1), dim=0)
        seeds = image_seeds(params.seed, len(prompts) * per_prompt)
        embeds = self.text_embeds(prompts, params)
        latent_h, latent_w = self._latent_size(height, width)
        noise = initial_noise((num_layers + 1, self.latent_channels, latent_h, latent_w), seeds,
                              self.dtype, self.device)
        latents = pack_latents(noise)
        num_steps = params.num_inference_steps
        mu = (condition.shape[1] / _BASE_SEQ_LEN) ** 0.5
        scheduler = self.scheduler(num_steps, mu, np.linspace(1.0, 0, num_steps + 1)[:-1])
        cond_frame = (1, cond_h // self.size_multiple, cond_w // self.size_multiple)
        inputs = ModelInputs(
            img_shapes=[(1, latent_h // 2, latent_w // 2)] * (num_layers + 1) + [cond_frame],
            image_latents=condition,
            additional_t_cond=torch.zeros(len(seeds), dtype=torch.long, device=self.device))
        latents = self.denoise(latents, scheduler, embeds, self.guidance(params), inputs, hooks)
        layers = [] if params.output_type == "latent" else [
            to_pil(image) for image in self.decode_layers(latents, num_layers, height, width)]
        return VisualGenOutput(layers, latents if self._keeps_latents(params) else None, seeds)

    def check_request(self, params: VisualGenParams, images: Sequence[Any] | None,
                      prompts: list[str]) -> None:
        if not images:
            raise ValueError("image: this model decomposes an input image into layers; "
                             "give one")
        if len(images) not in (1, len(prompts)):
            raise ValueError(f"image: give one image, or one per prompt ({len(prompts)}), "
                             f"got {len(images)}")
        if any(not p.strip() for p in prompts) and self.processor is None:
            raise ValueError("prompt: give a caption of the input image (this model folder "
                             "has no processor/ for automatic captions)")
        for name in ("height", "width"):
            check(getattr(params, name) is None, name, getattr(params, name),
                  "is not used by layered models (the size follows the input image and "
                  "resolution)")
        if self.transformer.config.guidance_embeds:
            check(params.guidance_scale is not None, "guidance_scale", params.guidance_scale,
                  "is required: the model is guidance-distilled")

    def bucket(self, images: Sequence[Any], resolution: int) -> tuple[int, int]:
        """(height, width) the inputs are resized to: their aspect ratio at about
        resolution^2 pixels, in multiples of 32 (diffusers' buckets); every input image of a
        request must land on the same. The output is this, floored to size_multiple."""
        sizes = {bucket_size(image.size, resolution) for image in images}
        if len(sizes) > 1:
            raise ValueError(f"image: the images of one request must have the same aspect "
                             f"ratio; they give sizes {sorted(sizes)}")
        height, width = sizes.pop()
        if min(height, width) < self.size_multiple:
            raise ValueError(f"image: aspect ratio too extreme for resolution {resolution}")
        return height, width

    def fill_captions(self, prompts: list[str], images: Sequence[Any],
                      language: str) -> list[str]:
        """Prompts, each empty one replaced by a caption of its image."""
        from tllm.visual_gen.models.qwen_image.caption import caption_image
        return [prompt if prompt.strip() else caption_image(
                    self.processor, self.text_encoder, images[i if len(images) > 1 else 0],
                    language)
                for i, prompt in enumerate(prompts)]

    @torch.no_grad()
    def encode_images(self, images: Sequence[Any]) -> torch.Tensor:
        """Input images, resized to the bucket already, as normalised packed VAE latents."""
        mode = "RGBA" if getattr(self.vae.config, "input_channels", 3) == 4 else "RGB"
        pixels = np.stack([np.asarray(image.convert(mode)).astype(np.float32) / 255.0
                           for image in images])
        pixels = torch.from_numpy(pixels).permute(0, 3, 1, 2) * 2.0 - 1.0   # (N, C, H, W)
        pixels = pixels.unsqueeze(2).to(device=self.device, dtype=self.dtype)
        z = self.vae.encode(pixels).latent_dist.mode()                      # (N, C, 1, h, w)
        mean, std = self._latent_stats(z)
        z = (z - mean) / std
        return pack_latents(z.permute(0, 2, 1, 3, 4))

    @torch.no_grad()
    def decode_layers(self, latents: torch.Tensor, num_layers: int, height: int,
                      width: int) -> torch.Tensor:
        """Packed latents of layers + 1 frames to RGBA layers (N, num_layers, 4, H, W) in
        [0, 1] (the first frame, the recomposed input, is dropped)."""
        latent_h, latent_w = self._latent_size(height, width)
        z = unpack_latents(latents, num_layers + 1, latent_h, latent_w)[:, :, 1:]
        n, channels = z.shape[:2]
        z = z.permute(0, 2, 1, 3, 4).reshape(n * num_layers, channels, 1, latent_h, latent_w)
        pixels = self._vae_decode(z)[:, :, 0]
        return pixels.view(n, num_layers, *pixels.shape[1:])


def bucket_size(size: tuple[int, int], resolution: int) -> tuple[int, int]:
    """(height, width) with the aspect ratio of a (width, height) size and about
    resolution^2 pixels, rounded to multiples of 32."""
    ratio = size[0] / size[1]
    width = math.sqrt(resolution * resolution * ratio)
    height = width / ratio
    return (round(height / _BUCKET_MULTIPLE) * _BUCKET_MULTIPLE,
            round(width / _BUCKET_MULTIPLE) * _BUCKET_MULTIPLE)


def _lanczos():
    from PIL import Image
    return Image.Resampling.LANCZOS
