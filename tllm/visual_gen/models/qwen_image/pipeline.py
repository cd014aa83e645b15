"""Qwen-Image text-to-image: prompts through Qwen2.5-VL (in Qwen-Image's prompt template), noise
packed into 2x2 latent patches, the shared denoising loop, then the VAE.

Numerics follow diffusers' QwenImagePipeline (same template and dropped prefix, same
dynamic-shift schedule, same noise for the same seed), so the two agree on the same weights.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from tllm.visual_gen.models.qwen_image.components import (
    QwenImageComponents, dummy_components, dummy_parameter_count, load_components)
from tllm.visual_gen.params import VisualGenParams, check
from tllm.visual_gen.pipeline import (DenoiseHook, Guidance, ModelInputs, TextEmbeds,
                                      VisualGenOutput, VisualPipeline, image_seeds,
                                      initial_noise, to_pil)
from tllm.visual_gen.schedulers import FlowMatchEulerScheduler, calculate_shift

logger = logging.getLogger(__name__)

# The system prompt Qwen-Image was trained with; the states of its first 34 tokens (the
# system turn and the user turn's header) are dropped, leaving the prompt and what follows.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
PROMPT_TEMPLATE_PREFIX_TOKENS = 34
MAX_TEXT_TOKENS = 512           # text states kept per prompt (diffusers' max_sequence_length)
DEFAULT_LATENT_SIZE = 128       # default image side, in latent pixels


class QwenImagePipeline(VisualPipeline):
    """Qwen-Image: text to one RGB image per seed."""

    # Tokens the tokenizer keeps (prompt plus template); None keeps all.
    max_prompt_tokens: int | None = 1024 + PROMPT_TEMPLATE_PREFIX_TOKENS
    cfg_normalize = True

    def __init__(self, components: QwenImageComponents) -> None:
        self.tokenizer = components.tokenizer
        self.text_encoder = components.text_encoder
        self.vae = components.vae
        self.transformer = components.transformer
        self.scheduler_config = components.scheduler_config
        self.processor = components.processor
        self.vae_scale_factor = 2 ** len(self.vae.config.temperal_downsample)
        self.latent_channels = self.transformer.config.in_channels // 4
        self.dtype = self.text_encoder.dtype

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype, device: torch.device,
                        transformer_impl: str = "auto") -> QwenImagePipeline:
        return cls(load_components(path, dtype, device, transformer_impl))

    @classmethod
    def from_dummy(cls, name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   transformer_impl: str = "auto") -> QwenImagePipeline:
        return cls(dummy_components(name, dtype, device, seed, transformer_impl))

    @classmethod
    def dummy_parameter_count(cls, name: str) -> int:
        return dummy_parameter_count(name)

    @property
    def size_multiple(self) -> int:
        """Image sides are multiples of this: VAE downsampling x the 2x2 latent patch."""
        return self.vae_scale_factor * 2

    @property
    def default_size(self) -> int:
        return DEFAULT_LATENT_SIZE * self.vae_scale_factor

    # ---- generation ----

    @torch.no_grad()
    def generate(self, prompts: list[str], params: VisualGenParams,
                 images: Sequence[Any] | None = None,
                 hooks: Sequence[DenoiseHook] = ()) -> VisualGenOutput:
        self.check_request(params, images, prompts)
        seeds = image_seeds(params.seed, len(prompts) * params.num_images_per_prompt)
        return self.generate_from_embeds(self.text_embeds(prompts, params), seeds, params,
                                         hooks)

    @torch.no_grad()
    def generate_from_embeds(self, embeds: TextEmbeds, seeds: list[int],
                             params: VisualGenParams,
                             hooks: Sequence[DenoiseHook] = ()) -> VisualGenOutput:
        """One image per seed from its text states (the images of several requests can share
        a call: visual_gen/batching.py)."""
        height = params.height or self.default_size
        width = params.width or self.default_size
        latent_h, latent_w = self._latent_size(height, width)
        noise = initial_noise((1, self.latent_channels, latent_h, latent_w), seeds, self.dtype,
                              self.device)
        latents = pack_latents(noise)
        scheduler = self.scheduler(params.num_inference_steps,
                                   calculate_shift(latents.shape[1], self.scheduler_config))
        inputs = ModelInputs(img_shapes=[(1, latent_h // 2, latent_w // 2)])
        latents = self.denoise(latents, scheduler, embeds, self.guidance(params), inputs, hooks)
        images_out = [] if params.output_type == "latent" else to_pil(
            self.decode(latents, height, width))
        return VisualGenOutput(images_out, latents if self._keeps_latents(params) else None,
                               seeds)

    def check_request(self, params: VisualGenParams, images: Sequence[Any] | None,
                      prompts: list[str]) -> None:
        """The rules that depend on the model (VisualGenParams checked the rest)."""
        if images is not None:
            raise ValueError("this model generates from text only: give no input image")
        for name in ("height", "width"):
            value = getattr(params, name)
            check(value is None or value % self.size_multiple == 0, name, value,
                  f"must be a multiple of {self.size_multiple} for this model")
        check(params.layers is None, "layers", params.layers, "is for layered models only")
        check(params.resolution is None, "resolution", params.resolution,
              "is for layered models only")
        if self.transformer.config.guidance_embeds:
            check(params.guidance_scale is not None, "guidance_scale", params.guidance_scale,
                  "is required: the model is guidance-distilled")

    def text_embeds(self, prompts: list[str], params: VisualGenParams) -> TextEmbeds:
        """Each image's prompt states (prompt-major), and the negative prompt's with CFG."""
        per_prompt = params.num_images_per_prompt
        cond = [s for s in self.encode_prompts(prompts) for _ in range(per_prompt)]
        uncond = None
        if params.is_cfg:
            negative = self.encode_prompts([params.negative_prompt])[0]
            uncond = [negative] * len(cond)
        return TextEmbeds(cond, uncond)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[torch.Tensor]:
        """Qwen2.5-VL's last hidden states of each prompt in the template, without the
        template's prefix, at most MAX_TEXT_TOKENS of them: (L_i, D) each."""
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        limits = ({} if self.max_prompt_tokens is None
                  else {"max_length": self.max_prompt_tokens, "truncation": True})
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt", **limits)
        input_ids = tokens.input_ids.to(self.device)
        mask = tokens.attention_mask.to(self.device)
        # The language model's states are the same as the full model's; skipping the
        # full model skips its LM head over the whole prompt.
        encoder = getattr(self.text_encoder, "model", self.text_encoder)
        hidden = encoder(input_ids=input_ids, attention_mask=mask,
                         output_hidden_states=True).hidden_states[-1]
        return [states[row_mask.bool()][PROMPT_TEMPLATE_PREFIX_TOKENS:][:MAX_TEXT_TOKENS]
                .to(self.dtype) for states, row_mask in zip(hidden, mask)]

    def guidance(self, params: VisualGenParams) -> Guidance:
        distilled = None
        if self.transformer.config.guidance_embeds:
            distilled = params.guidance_scale
        elif params.guidance_scale is not None:
            logger.warning("guidance_scale is ignored: the model is not guidance-distilled "
                           "(true_cfg_scale with a negative_prompt guides it)")
        normalize = self.cfg_normalize if params.cfg_normalize is None else params.cfg_normalize
        return Guidance(params.true_cfg_scale, normalize, distilled)

    def scheduler(self, num_steps: int, mu: float,
                  sigmas: np.ndarray | None = None) -> FlowMatchEulerScheduler:
        scheduler = FlowMatchEulerScheduler(self.scheduler_config)
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        scheduler.set_timesteps(num_steps, mu=mu, sigmas=sigmas, device=self.device)
        return scheduler

    # ---- latents ----

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents (N, S, C) to images (N, 3, H, W) in [0, 1]."""
        latent_h, latent_w = self._latent_size(height, width)
        z = unpack_latents(latents, 1, latent_h, latent_w)        # (N, C, 1, h, w)
        return self._vae_decode(z)[:, :, 0]

    def _vae_decode(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latents (N, C, F, h, w) to images in [0, 1] (N, 3 or 4, F, H, W)."""
        z = z.to(self.vae.dtype)
        mean, std = self._latent_stats(z)
        z = z / (1.0 / std) + mean      # diffusers' order of operations
        image = self.vae.decode(z, return_dict=False)[0]
        return (image * 0.5 + 0.5).clamp(0, 1)

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def _latent_size(self, height: int, width: int) -> tuple[int, int]:
        return (2 * (height // self.size_multiple), 2 * (width // self.size_multiple))

    @staticmethod
    def _keeps_latents(params: VisualGenParams) -> bool:
        return params.return_latents or params.output_type == "latent"


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(N, F, C, h, w) latents to the transformer's tokens (N, F * h/2 * w/2, C * 4): frame
    by frame, each 2x2 patch one token with channels outermost."""
    n, frames, channels, h, w = latents.shape
    patches = latents.view(n, frames, channels, h // 2, 2, w // 2, 2)
    patches = patches.permute(0, 1, 3, 5, 2, 4, 6)
    return patches.reshape(n, frames * (h // 2) * (w // 2), channels * 4)


def unpack_latents(tokens: torch.Tensor, frames: int, h: int, w: int) -> torch.Tensor:
    """The inverse of pack_latents, as the VAE wants it: (N, C, F, h, w)."""
    n, _, packed = tokens.shape
    channels = packed // 4
    patches = tokens.view(n, frames, h // 2, w // 2, channels, 2, 2)
    patches = patches.permute(0, 4, 1, 2, 5, 3, 6)
    return patches.reshape(n, channels, frames, h, w)
