"""FLUX.1 text-to-image (dev and schnell): the prompt through CLIP (pooled) and T5 (states,
padded to 512 tokens), noise packed into 2x2 latent patches with (0, row, column) position
ids, the shared denoising loop (FLUX.1-dev's distilled guidance fed to the transformer, true
CFG over [uncond, cond] when a negative prompt is given), then the VAE.

Numerics follow diffusers' FluxPipeline (same padding, schedule, noise for the same seed), so
the two agree on the same weights."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from tllm.visual_gen.models.flux.components import (FluxComponents, dummy_components,
                                                    dummy_parameter_count, load_components)
from tllm.visual_gen.models.qwen_image.pipeline import pack_latents, unpack_latents
from tllm.visual_gen.params import VisualGenParams, check
from tllm.visual_gen.pipeline import (ClassifierFreeGuidance, DenoiseHook, DenoiseStep,
                                      VisualGenOutput, VisualPipeline, denoise_streams,
                                      image_seeds, initial_noise, to_pil)
from tllm.visual_gen.schedulers import FlowMatchEulerScheduler, calculate_shift

logger = logging.getLogger(__name__)
MAX_T5_TOKENS = 512             # diffusers' max_sequence_length
DEFAULT_LATENT_SIZE = 128       # default image side, in latent pixels (1024 px)
DEFAULT_GUIDANCE = 3.5          # FLUX.1-dev's distilled guidance scale


class FluxPipeline(VisualPipeline):
    """FLUX.1: text to one RGB image per seed."""

    def __init__(self, components: FluxComponents) -> None:
        self.tokenizer, self.text_encoder = components.tokenizer, components.text_encoder
        self.tokenizer_2, self.text_encoder_2 = components.tokenizer_2, components.text_encoder_2
        self.vae = components.vae
        self.transformer = components.transformer
        self.scheduler_config = components.scheduler_config
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_channels = self.transformer.config.in_channels // 4
        self.dtype = self.text_encoder_2.dtype

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype, device: torch.device,
                        transformer_impl: str = "auto") -> FluxPipeline:
        return cls(load_components(path, dtype, device, transformer_impl))

    @classmethod
    def from_dummy(cls, name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   transformer_impl: str = "auto") -> FluxPipeline:
        return cls(dummy_components(name, dtype, device, seed, transformer_impl))

    @classmethod
    def dummy_parameter_count(cls, name: str) -> int:
        return dummy_parameter_count(name)

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2

    @property
    def is_distilled(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    # ---- generation ----

    @torch.no_grad()
    def generate(self, prompts: list[str], params: VisualGenParams,
                 images: Sequence[Any] | None = None,
                 hooks: Sequence[DenoiseHook] = ()) -> VisualGenOutput:
        self.check_request(params, images, prompts)
        default = DEFAULT_LATENT_SIZE * self.vae_scale_factor
        height, width = params.height or default, params.width or default
        seeds = image_seeds(params.seed, len(prompts) * params.num_images_per_prompt)
        latent_h, latent_w = self._latent_size(height, width)
        noise = initial_noise((self.latent_channels, latent_h, latent_w), seeds, self.dtype,
                              self.device)
        latents = pack_latents(noise[:, None])
        latents = self.denoise_latents(latents, self.text_inputs(prompts, params),
                                       self.scheduler(params.num_inference_steps,
                                                      latents.shape[1]),
                                       self.image_ids(latent_h // 2, latent_w // 2),
                                       params, hooks)
        keep = params.return_latents or params.output_type == "latent"
        images_out = [] if params.output_type == "latent" else to_pil(
            self.decode(latents, height, width))
        return VisualGenOutput(images_out, latents if keep else None, seeds)

    def check_request(self, params: VisualGenParams, images, prompts) -> None:
        if images is not None:
            raise ValueError("this model generates from text only: give no input image")
        for name in ("height", "width"):
            value = getattr(params, name)
            check(value is None or value % self.size_multiple == 0, name, value,
                  f"must be a multiple of {self.size_multiple} for this model")
        for name in ("layers", "resolution", "num_frames"):
            check(getattr(params, name) is None, name, getattr(params, name),
                  "is not for this model")

    def text_inputs(self, prompts: list[str], params: VisualGenParams):
        """[uncond..., cond...] (T5 states, pooled CLIP) per image; uncond only with true CFG."""
        per_prompt = params.num_images_per_prompt
        states, pooled = self.encode_prompts(prompts)
        states = states.repeat_interleave(per_prompt, 0)
        pooled = pooled.repeat_interleave(per_prompt, 0)
        if not params.is_cfg:
            return states, pooled
        neg_states, neg_pooled = self.encode_prompts([params.negative_prompt])
        count = len(states)
        return (torch.cat([neg_states.expand(count, -1, -1), states]),
                torch.cat([neg_pooled.expand(count, -1), pooled]))

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """T5's states [N, 512, D] (padding included, as FLUX was trained) and CLIP's pooled
        output [N, D']."""
        clip_ids = self.tokenizer(prompts, padding="max_length",
                                  max_length=self.tokenizer.model_max_length, truncation=True,
                                  return_tensors="pt").input_ids.to(self.device)
        pooled = self.text_encoder(clip_ids, output_hidden_states=False).pooler_output
        t5_ids = self.tokenizer_2(prompts, padding="max_length", max_length=MAX_T5_TOKENS,
                                  truncation=True, return_tensors="pt").input_ids.to(self.device)
        states = self.text_encoder_2(t5_ids, output_hidden_states=False)[0]
        return states.to(self.dtype), pooled.to(self.text_encoder.dtype)

    def scheduler(self, num_steps: int, image_seq_len: int) -> FlowMatchEulerScheduler:
        scheduler = FlowMatchEulerScheduler(self.scheduler_config)
        mu = calculate_shift(image_seq_len, self.scheduler_config)
        scheduler.set_timesteps(num_steps, mu=mu, device=self.device,
                                sigmas=np.linspace(1.0, 1 / num_steps, num_steps))
        return scheduler

    def image_ids(self, rows: int, cols: int) -> torch.Tensor:
        """(0, row, column) per packed latent token, [rows * cols, 3]."""
        ids = torch.zeros(rows, cols, 3)
        ids[..., 1] += torch.arange(rows)[:, None]
        ids[..., 2] += torch.arange(cols)[None, :]
        return ids.reshape(-1, 3).to(self.device, self.dtype)

    def denoise_latents(self, latents: torch.Tensor, text, scheduler, img_ids: torch.Tensor,
                        params: VisualGenParams, hooks: Sequence[DenoiseHook]) -> torch.Tensor:
        states, pooled = text
        num_copies = len(states) // len(latents)
        rule = ClassifierFreeGuidance(params.true_cfg_scale if num_copies == 2 else 1.0)
        txt_ids = torch.zeros(states.shape[1], 3, device=self.device, dtype=self.dtype)
        guidance = None
        if not self.is_distilled and params.guidance_scale is not None:
            logger.warning("guidance_scale is ignored: the model is not guidance-distilled "
                           "(true_cfg_scale with a negative_prompt guides it)")
        if self.is_distilled:
            scale = DEFAULT_GUIDANCE if params.guidance_scale is None else params.guidance_scale
            guidance = torch.full((len(states),), scale, device=self.device,
                                  dtype=torch.float32)

        def predict(step: DenoiseStep) -> dict[str, list[torch.Tensor]]:
            hidden = step.latents.repeat(num_copies, 1, 1)
            timestep = step.timestep.expand(len(hidden)).to(hidden.dtype) / 1000
            out = self.transformer(hidden, states, pooled, timestep, img_ids, txt_ids, guidance,
                                   **step.model_kwargs)     # the step cache, if any
            return {"latents": list(out.chunk(num_copies))}

        streams = denoise_streams({"latents": latents}, {"latents": scheduler}, predict, rule,
                                  hooks, self.show_progress)
        return streams["latents"]

    # ---- latents ----

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents (N, S, C) to images (N, 3, H, W) in [0, 1]."""
        latent_h, latent_w = self._latent_size(height, width)
        z = unpack_latents(latents, 1, latent_h, latent_w)[:, :, 0].to(self.vae.dtype)
        config = self.vae.config
        z = z / config.scaling_factor + config.shift_factor
        image = self.vae.decode(z, return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)

    def _latent_size(self, height: int, width: int) -> tuple[int, int]:
        return (2 * (height // self.size_multiple), 2 * (width // self.size_multiple))
