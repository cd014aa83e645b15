"""LTX-2 text-to-video and image-to-video with sound: Gemma 3 encodes the prompt (all its layers' states), the
connectors turn that into the video's and the audio's prompt tokens, noise in the video VAE's
and the audio VAE's latent spaces goes through the shared denoising loop as two streams
(video, audio) with one flow-match Euler scheduler each and LTX-2's guidance (guidance.py),
then the video VAE decodes frames and the audio VAE + vocoder a waveform. Image-to-video
(diffusers' LTX2ImageToVideoPipeline) encodes the image, re-compressed as H.264 at CRF 33 as
LTX-2 was trained, into the first latent frame and keeps it clean: its tokens see timestep 0
and the scheduler does not move them.

Numerics follow diffusers' LTX2Pipeline (the same tokenisation and padding, the same noise
for the same seed, the same schedule, guidance in float32), so the two agree on the same
weights. The guidance branches of a step run as one batch of the transformer. Not here yet:
prompt enhancement, a settable image CRF, LTX-2.3's options, the two-stage upsampling."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from tllm.visual_gen.models.ltx2.conditioning import KeepCleanTokens, preprocess_image
from tllm.visual_gen.models.ltx2.components import (
    LTX2Components, dummy_components, dummy_parameter_count, load_components)
from tllm.visual_gen.models.ltx2.guidance import LTX2Guidance, StreamScales
from tllm.visual_gen.models.ltx2.rope import LTX2Rope, audio_positions, video_positions
from tllm.visual_gen.models.ltx2.transformer import LTX2Inputs
from tllm.visual_gen.params import VisualGenParams
from tllm.visual_gen.pipeline import DenoiseHook, DenoiseStep, denoise_streams
from tllm.visual_gen.schedulers import FlowMatchEulerScheduler, calculate_shift
from tllm.visual_gen.video_pipeline import (VideoPipeline, VideoSample, to_uint8, vae_frames,
                                            with_defaults)

# diffusers' LTX2Pipeline defaults (its STG scale is moot: see guidance.py)
DEFAULTS = dict(num_frames=121, height=512, width=768, frame_rate=24.0, guidance_scale=3.0,
                audio_guidance_scale=7.0, modality_scale=3.0, guidance_rescale=0.7)
MAX_TEXT_TOKENS = 1024      # diffusers' max_sequence_length (the tokenizer's limit if lower)


@dataclass(frozen=True)
class VideoRequest:
    """A request's settings with the model's defaults filled in."""
    num_frames: int
    height: int
    width: int
    frame_rate: float
    guidance_scale: float
    audio_guidance_scale: float
    modality_scale: float
    guidance_rescale: float
    num_inference_steps: int
    negative_prompt: str | None

    @classmethod
    def resolve(cls, params: VisualGenParams) -> VideoRequest:
        return cls(**with_defaults(params, DEFAULTS),
                   num_inference_steps=params.num_inference_steps,
                   negative_prompt=params.negative_prompt)

    def scales(self) -> dict[str, StreamScales]:
        return {"video": StreamScales(self.guidance_scale, self.modality_scale,
                                      self.guidance_rescale),
                "audio": StreamScales(self.audio_guidance_scale, self.modality_scale,
                                      self.guidance_rescale)}


@dataclass(frozen=True)
class LatentGrid:
    """The latent shapes of one request: video (frames, rows, columns), audio (frames, mel)."""
    frames: int
    height: int
    width: int
    audio_frames: int
    mel_bins: int


class LTX2Pipeline(VideoPipeline):
    """LTX-2: a video and its soundtrack per seed."""

    defaults = DEFAULTS
    use_cross_timestep = True   # diffusers' default (LTX-2.3's rule; equal for text-to-video)

    def __init__(self, components: LTX2Components) -> None:
        self.tokenizer = components.tokenizer
        self.text_encoder = components.text_encoder
        self.connectors = components.connectors
        self.transformer = components.transformer
        self.vae, self.audio_vae, self.vocoder = (components.vae, components.audio_vae,
                                                  components.vocoder)
        self.scheduler_config = components.scheduler_config
        self.config = self.transformer.config
        self.spatial = int(self.vae.spatial_compression_ratio)
        self.temporal = int(self.vae.temporal_compression_ratio)
        self.size_multiple = math.lcm(32, self.spatial * self.config.patch_size)
        self.max_text_tokens = min(MAX_TEXT_TOKENS, int(self.tokenizer.model_max_length))
        self.tokenizer.padding_side = "left"        # as Gemma's chat prompts are padded
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    @property
    def sample_rate(self) -> int:
        return int(self.vocoder.config.output_sampling_rate)

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

    def resolve(self, params: VisualGenParams) -> VideoRequest:
        return VideoRequest.resolve(params)

    def sample(self, prompt: str, request: VideoRequest, seed: int, image,
               hooks: Sequence[DenoiseHook], decode: bool) -> VideoSample:
        final = self.denoise_video(prompt, request, seed, hooks, image)
        if not decode:
            return VideoSample(final["video"])
        grid = self.latent_grid(request)
        return VideoSample(final["video"], to_uint8(self.decode_video(final["video"], grid)),
                           self.decode_audio(final["audio"], grid)[0].float().cpu())

    def denoise_video(self, prompt: str, request: VideoRequest, seed: int,
                      hooks: Sequence[DenoiseHook] = (), image=None) -> dict[str, torch.Tensor]:
        """The final packed latents of one video: {"video": (1, S, C), "audio": (1, L, C_a)},
        float32, normalised as the transformer sees them; `image` makes it image-to-video."""
        grid = self.latent_grid(request)
        first = None if image is None else self.encode_image(image, request)
        streams = self.initial_latents(grid, torch.Generator("cpu").manual_seed(seed), first)
        clean = 0
        if first is not None:
            p = self.config.patch_size
            clean = self.config.patch_size_t * (grid.height // p) * (grid.width // p)
            hooks = [KeepCleanTokens("video", streams["video"][:, :clean]), *hooks]
        schedulers = {name: self.scheduler(request.num_inference_steps, grid)
                      for name in streams}
        guidance = LTX2Guidance(request.scales(), schedulers["video"].sigmas)
        text = self.encode_text(prompt, request.negative_prompt, guidance)
        rope = LTX2Rope.build(self.config, *self.positions(grid, request.frame_rate))
        num = guidance.num_branches
        cross_rows = None
        if guidance.has_isolated:
            cross_rows = torch.ones(num, device=self.device)
            cross_rows[-1] = 0

        def predict(step: DenoiseStep) -> dict[str, list[torch.Tensor]]:
            video, audio = (step.streams[name].expand(num, -1, -1) for name in ("video", "audio"))
            inputs = LTX2Inputs(video, audio, step.timestep.expand(num), text, rope, clean,
                                use_cross_timestep=self.use_cross_timestep,
                                cross_rows=cross_rows,
                                step_cache=step.model_kwargs.get("step_cache"))
            video_out, audio_out = self.transformer(inputs)
            return {"video": list(video_out.float().chunk(num)),
                    "audio": list(audio_out.float().chunk(num))}

        return denoise_streams(streams, schedulers, predict, guidance, hooks,
                               self.show_progress)

    def latent_grid(self, request: VideoRequest) -> LatentGrid:
        audio_vae = self.audio_vae
        per_second = (audio_vae.config.sample_rate / audio_vae.config.mel_hop_length
                      / float(audio_vae.temporal_compression_ratio))
        return LatentGrid(*self.latent_size(request.num_frames, request.height, request.width),
                          round(request.num_frames / request.frame_rate * per_second),
                          audio_vae.config.mel_bins // audio_vae.mel_compression_ratio)

    def initial_latents(self, grid: LatentGrid, generator,
                        first_frame: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Packed float32 noise, the video's drawn first, then the audio's, from one generator
        (diffusers' order); with `first_frame` (1, C, 1, h, w) latents the video's first frame
        is that image."""
        video = torch.randn((1, self.config.in_channels // self.config.patch_size ** 2
                             // self.config.patch_size_t, grid.frames, grid.height, grid.width),
                            generator=generator, dtype=torch.float32)
        if first_frame is not None:
            video[:, :, :1] = first_frame.cpu()
        audio = torch.randn((1, self.audio_vae.config.latent_channels, grid.audio_frames,
                             grid.mel_bins), generator=generator, dtype=torch.float32)
        return {"video": self.pack(video).to(self.device),
                "audio": audio.transpose(1, 2).flatten(2, 3).to(self.device)}

    def scheduler(self, num_steps: int, grid: LatentGrid) -> FlowMatchEulerScheduler:
        scheduler = FlowMatchEulerScheduler(self.scheduler_config)
        p, pt = self.config.patch_size, self.config.patch_size_t
        num_tokens = (grid.frames // pt) * (grid.height // p) * (grid.width // p)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        scheduler.set_timesteps(num_steps, mu=calculate_shift(num_tokens, self.scheduler_config),
                                sigmas=sigmas, device=self.device)
        return scheduler

    def positions(self, grid: LatentGrid, frame_rate: float):
        return (video_positions(grid.frames, grid.height, grid.width, self.config, frame_rate,
                                self.device),
                audio_positions(grid.audio_frames, self.config, self.device))

    # ---- the prompt ----

    def encode_text(self, prompt: str, negative: str | None, guidance: LTX2Guidance):
        """The transformer's prompt context, one row per guidance branch: [negative prompt
        ("" when none)] if CFG runs, the prompt, [the prompt] for the isolated branch."""
        prompts = ([negative or ""] if guidance.has_uncond else []) + [prompt]
        states, mask = self.text_states(prompts)
        video, audio, mask = self.connectors(states, mask, padding_side="left")
        rows = list(range(len(prompts))) + ([len(prompts) - 1] if guidance.has_isolated else [])
        rows = torch.tensor(rows, device=video.device)
        return self.transformer.encode_text(video[rows], audio[rows], mask[rows])

    def text_states(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every hidden state of the text encoder, stacked per token: [B, L, D * layers]."""
        tokens = self.tokenizer([p.strip() for p in prompts], padding="max_length",
                                max_length=self.max_text_tokens, truncation=True,
                                add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        out = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        states = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)
        return states.to(self.text_encoder.dtype), mask

    # ---- latents and decoding ----

    @torch.no_grad()
    def encode_image(self, image, request: VideoRequest) -> torch.Tensor:
        """The conditioning image -> normalised latents (1, C, 1, h, w), float32: the mode of
        the VAE's posterior, as diffusers encodes it."""
        vae = self.vae
        pixels = preprocess_image(image, request.height, request.width, self.spatial)
        pixels = pixels.to(self.device, self.transformer.dtype)
        mode = vae.encode(pixels[:, :, None].to(vae.dtype)).latent_dist.mode().float()
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(mode.device, mode.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(mode.device, mode.dtype)
        return (mode - mean) / std

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, F, H, W) -> (B, F/pt * H/p * W/p, C * pt * p * p), as diffusers packs."""
        p, pt = self.config.patch_size, self.config.patch_size_t
        b, c, f, h, w = latents.shape
        patches = latents.reshape(b, c, f // pt, pt, h // p, p, w // p, p)
        return patches.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)

    def unpack(self, latents: torch.Tensor, grid: LatentGrid) -> torch.Tensor:
        p, pt = self.config.patch_size, self.config.patch_size_t
        b = latents.shape[0]
        patches = latents.reshape(b, grid.frames // pt, grid.height // p, grid.width // p, -1,
                                  pt, p, p)
        return patches.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor, grid: LatentGrid) -> torch.Tensor:
        """Packed latents (1, S, C) -> frames (F, H, W, 3) in [0, 1], float32."""
        vae = self.vae
        z = self.unpack(latents, grid).to(self.transformer.dtype)
        timestep = None
        if vae.config.timestep_conditioning:    # decode_timestep 0: no noise mixed in
            timestep = torch.zeros(1, device=z.device, dtype=z.dtype)
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        z = z * std / vae.config.scaling_factor + mean
        return vae_frames(vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0].float())

    @torch.no_grad()
    def decode_audio(self, latents: torch.Tensor, grid: LatentGrid) -> torch.Tensor:
        """Packed latents (1, L, C * M) -> waveform (1, channels, samples)."""
        vae = self.audio_vae
        mean, std = (t.to(latents.device, latents.dtype) for t in (vae.latents_mean,
                                                                    vae.latents_std))
        z = (latents * std + mean).unflatten(2, (-1, grid.mel_bins)).transpose(1, 2)
        mel = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return self.vocoder(mel)


class LTX2ImageToVideoPipeline(LTX2Pipeline):
    """A folder saved from diffusers' LTX2ImageToVideoPipeline: an input image is required."""

    takes_image = True

