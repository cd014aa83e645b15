"""Wan 2.1 / 2.2 text-to-video: prompts cleaned and through UMT5 (states past the prompt
zeroed, 512 tokens), noise in the VAE's latent space, the shared denoising loop with UniPC
and classifier-free guidance over [uncond, cond] (the negative prompt, or "", whenever the
scale is above 1), each step on the high-noise expert while the timestep is at least
boundary_ratio * 1000 and on the low-noise one after (Wan 2.2 A14B; one transformer
otherwise), then the VAE.

Numerics follow diffusers' WanPipeline (same prompt cleaning, padding, float32 latents, noise
for the same seed), so the two agree on the same weights. Text-to-video only: TI2V-5B's image
conditioning is not here."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from tllm.visual_gen.models.wan.components import (WanComponents, dummy_components,
                                                   dummy_parameter_count, load_components)
from tllm.visual_gen.params import VisualGenParams
from tllm.visual_gen.pipeline import (ClassifierFreeGuidance, DenoiseHook, DenoiseStep,
                                      denoise_streams)
from tllm.visual_gen.unipc import UniPCScheduler
from tllm.visual_gen.video_pipeline import (VideoPipeline, VideoSample, to_uint8, vae_frames,
                                            with_defaults)

MAX_TEXT_TOKENS = 512       # diffusers' max_sequence_length
# diffusers' WanPipeline defaults (480p, 81 frames, 16 fps: Wan 2.1 / 2.2 A14B), and
# TI2V-5B's 720p at 24 fps
DEFAULTS = dict(num_frames=81, height=480, width=832, frame_rate=16.0, guidance_scale=5.0)
DEFAULTS_TI2V_5B = dict(num_frames=121, height=704, width=1280, frame_rate=24.0,
                        guidance_scale=5.0)


@dataclass(frozen=True)
class WanRequest:
    num_frames: int
    height: int
    width: int
    frame_rate: float
    guidance_scale: float
    negative_prompt: str
    num_inference_steps: int


class WanPipeline(VideoPipeline):
    """Wan: a video per seed, from text."""

    def __init__(self, components: WanComponents) -> None:
        self.tokenizer, self.text_encoder = components.tokenizer, components.text_encoder
        self.vae = components.vae
        self.transformer, self.transformer_2 = components.transformer, components.transformer_2
        self.boundary_ratio = components.boundary_ratio
        if (self.transformer_2 is None) != (self.boundary_ratio is None):
            raise ValueError("a second transformer and boundary_ratio go together")
        self.scheduler_config = components.scheduler_config
        self.spatial = int(self.vae.config.scale_factor_spatial)
        self.temporal = int(self.vae.config.scale_factor_temporal)
        self.size_multiple = self.spatial * self.transformer.config.patch_size[1]
        self.defaults = DEFAULTS_TI2V_5B if self.vae.config.z_dim == 48 else DEFAULTS

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype, device, transformer_impl="auto"):
        return cls(load_components(path, dtype, device, transformer_impl))

    @classmethod
    def from_dummy(cls, name: str, dtype, device, seed: int = 0, transformer_impl="auto"):
        return cls(dummy_components(name, dtype, device, seed, transformer_impl))

    @classmethod
    def dummy_parameter_count(cls, name: str) -> int:
        return dummy_parameter_count(name)

    # ---- generation ----

    def check_request(self, params: VisualGenParams, images, prompts) -> None:
        if images is not None:
            raise ValueError("image: this model generates from text only (no image-to-video)")
        super().check_request(params, images, prompts)

    def resolve(self, params: VisualGenParams) -> WanRequest:
        return WanRequest(**with_defaults(params, self.defaults),
                          negative_prompt=params.negative_prompt or "",
                          num_inference_steps=params.num_inference_steps)

    def sample(self, prompt: str, request: WanRequest, seed: int, image,
               hooks: Sequence[DenoiseHook], decode: bool) -> VideoSample:
        final = self.denoise_video(prompt, request, seed, hooks)
        return VideoSample(final, to_uint8(self.decode(final)) if decode else None)

    def denoise_video(self, prompt: str, request: WanRequest, seed: int,
                      hooks: Sequence[DenoiseHook] = ()) -> torch.Tensor:
        """The final latents (1, C, T, h, w), float32, of one video."""
        generator = torch.Generator("cpu").manual_seed(seed)
        shape = (1, self.vae.config.z_dim,
                 *self.latent_size(request.num_frames, request.height, request.width))
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        scale = request.guidance_scale if request.guidance_scale > 1 else 1.0
        guidance = ClassifierFreeGuidance(scale)
        texts = [request.negative_prompt, prompt] if guidance.num_branches == 2 else [prompt]
        text = self.encode_prompts(texts)
        scheduler = UniPCScheduler(self.scheduler_config)
        scheduler.set_timesteps(request.num_inference_steps, device=self.device)

        def predict(step: DenoiseStep) -> dict[str, list[torch.Tensor]]:
            model = self.expert(step.timestep)
            hidden = step.latents.to(model.dtype).expand(len(texts), -1, -1, -1, -1)
            out = model(hidden, step.timestep.expand(len(texts)), text.to(model.dtype),
                        **step.model_kwargs)     # the step cache, if any
            return {"video": list(out.chunk(len(texts)))}

        streams = denoise_streams({"video": latents}, {"video": scheduler}, predict, guidance,
                                  hooks, self.show_progress)
        return streams["video"]

    def expert(self, timestep: torch.Tensor):
        """The transformer for this timestep: Wan 2.2 A14B's high-noise expert at and above
        the boundary, its low-noise one below."""
        if self.transformer_2 is None:
            return self.transformer
        boundary = self.boundary_ratio * self.scheduler_config.num_train_timesteps
        return self.transformer if float(timestep) >= boundary else self.transformer_2

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """UMT5's states [N, 512, D], zero past each prompt's tokens."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tokens = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=MAX_TEXT_TOKENS, truncation=True,
                                add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        states = self.text_encoder(ids, mask).last_hidden_state
        return torch.where(mask[..., None].bool(), states, torch.zeros_like(states))

    # ---- the VAE ----

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (1, C, T, h, w) -> frames (F, H, W, 3) in [0, 1], float32."""
        config, dtype = self.vae.config, self.vae.dtype
        mean = torch.tensor(config.latents_mean, dtype=dtype).view(1, -1, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(config.latents_std, dtype=dtype).view(1, -1, 1, 1, 1)
        z = latents.to(dtype) / inv_std.to(self.device) + mean.to(self.device)
        return vae_frames(self.vae.decode(z).sample.float())
