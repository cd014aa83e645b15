"""Cosmos 3 text-to-video, image-to-video and text-to-image: the prompt (with Cosmos 3's
duration and resolution sentences, in its chat template) tokenised for the transformer,
noise in the Wan 2.2 VAE's latent space, the shared denoising loop with UniPC and classifier-
free guidance over [uncond, cond], then the VAE.

Numerics follow diffusers' Cosmos3OmniPipeline (same templates and special tokens, same
positions, same noise for the same seed, guidance combined in float32), so the two agree on
the same weights. Not here yet: sound generation (the transformer runs a sound stream, the
pipeline does not decode one), video-to-video and the action modes."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from tllm.visual_gen.models.cosmos3.components import (
    Cosmos3Components, dummy_components, dummy_parameter_count, load_components)
from tllm.visual_gen.models.cosmos3.conditioning import preprocess_image
from tllm.visual_gen.models.cosmos3.rope import (JointLayout, MultimodalRope, grid_positions,
                                                 text_positions)
from tllm.visual_gen.models.cosmos3.transformer import GenTokens
from tllm.visual_gen.params import VisualGenParams
from tllm.visual_gen.pipeline import (ClassifierFreeGuidance, DenoiseHook, DenoiseStep,
                                      denoise_streams)
from tllm.visual_gen.unipc import UniPCScheduler
from tllm.visual_gen.video_pipeline import (VideoPipeline, VideoSample, to_uint8, vae_frames,
                                            with_defaults)

SYSTEM_PROMPT = "You are a helpful assistant who will generate {}s from a give prompt."
DEFAULTS = dict(num_frames=189, height=720, width=1280, frame_rate=24.0, guidance_scale=6.0)


class Cosmos3Pipeline(VideoPipeline):
    """Cosmos 3: a video (or an image, num_frames=1) per seed."""

    defaults = DEFAULTS

    def __init__(self, components: Cosmos3Components) -> None:
        self.tokenizer = components.tokenizer
        self.transformer = components.transformer
        self.vae = components.vae
        self.scheduler_config = components.scheduler_config
        self.use_native_flow_schedule = components.use_native_flow_schedule
        self.use_system_prompt = components.default_use_system_prompt
        config = self.transformer.config
        self.rope = MultimodalRope(config.head_dim, config.rope_theta, tuple(config.rope_axes_dim))
        self.spatial = int(self.vae.config.scale_factor_spatial)
        self.temporal = int(self.vae.config.scale_factor_temporal)
        self.size_multiple = self.spatial

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
        final = self.denoise_video(prompt, request, seed, image, hooks)
        return VideoSample(final, to_uint8(self.decode(final)) if decode else None)

    def denoise_video(self, prompt: str, request: VideoRequest, seed: int, image,
                      hooks: Sequence[DenoiseHook] = ()) -> torch.Tensor:
        """The final latents (1, C, T, h, w) of one video."""
        generator = torch.Generator("cpu").manual_seed(seed)
        latents, mask = self.initial_latents(request, image, generator)
        noisy = [f for f in range(latents.shape[2]) if mask[f] == 0]
        guidance = ClassifierFreeGuidance(request.guidance_scale, in_float32=True)
        texts = self.prompt_ids(prompt, request)
        texts = texts if guidance.num_branches == 2 else texts[1:]   # [uncond, cond]
        layouts = [self.layout(ids, latents.shape[2:], request) for ids in texts]
        scheduler = self.scheduler(request.num_inference_steps)

        def predict(step: DenoiseStep) -> dict[str, list[torch.Tensor]]:
            gen = GenTokens(step.streams["video"][0].to(self.transformer.dtype), None, noisy)
            vision, _ = self.transformer(gen, int(step.timestep), layouts,
                                         **step.model_kwargs)
            return {"video": list(vision[:, None])}

        streams = denoise_streams({"video": latents}, {"video": scheduler}, predict, guidance,
                                  hooks, self.show_progress)
        return streams["video"]

    def initial_latents(self, request: VideoRequest, image, generator):
        """Noise (1, C, T, h, w) in float32, with frame 0 the encoded image for
        image-to-video; and the per-frame condition mask (1 = kept clean)."""
        shape = (1, self.vae.config.z_dim,
                 *self.latent_size(request.num_frames, request.height, request.width))
        mask = torch.zeros(shape[2])
        noise = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        if image is None or request.num_frames == 1:
            return noise, mask      # t2v encodes nothing: diffusers' blend of 0 * x0 is 0
        frame = preprocess_image(image, request.height, request.width).to(self.device)
        video = frame.unsqueeze(2).expand(-1, -1, request.num_frames, -1, -1)
        x0 = self.encode(video)
        mask[0] = 1
        blend = mask.view(-1, 1, 1).to(self.device)
        return blend * x0 + (1.0 - blend) * noise, mask

    def scheduler(self, num_steps: int) -> UniPCScheduler:
        scheduler = UniPCScheduler(self.scheduler_config)
        sigmas = None
        if self.use_native_flow_schedule:
            num_train = self.scheduler_config.num_train_timesteps
            sigmas = np.linspace(1.0 - 1.0 / num_train, 0.0, num_steps + 1)[:-1]
        scheduler.set_timesteps(num_steps, sigmas=sigmas, device=self.device)
        return scheduler

    # ---- the joint sequence ----

    def prompt_ids(self, prompt: str, request: VideoRequest) -> list[torch.Tensor]:
        """[uncond, cond] token ids: the prompt and the negative prompt with the metadata
        sentences (negated for the negative prompt), ending in EOS and <|vision_start|>."""
        negative = request.negative_prompt or ""
        ends = [self.tokenizer.eos_token_id,
                self.tokenizer.convert_tokens_to_ids("<|vision_start|>")]
        out = []
        for text, negated in ((negative, True), (prompt, False)):
            turns = []
            kind = "image" if request.num_frames == 1 else "video"
            if self.use_system_prompt:
                turns.append({"role": "system", "content": SYSTEM_PROMPT.format(kind)})
            turns.append({"role": "user", "content": request.with_metadata(text, negated)})
            ids = self.tokenizer.apply_chat_template(
                turns, tokenize=True, add_generation_prompt=True, add_vision_id=False,
                return_dict=True).input_ids
            out.append(torch.tensor(list(ids) + ends, dtype=torch.long, device=self.device))
        return out

    def layout(self, input_ids: torch.Tensor, latent_shape, request: VideoRequest) -> JointLayout:
        config = self.transformer.config
        p = config.latent_patch_size
        t, h, w = latent_shape
        text, start = text_positions(len(input_ids), 0, config.enable_fps_modulation), len(
            input_ids)
        vision_start = start + config.unified_3d_mrope_temporal_modality_margin
        fps = request.frame_rate if config.enable_fps_modulation else None
        vision, _ = grid_positions((t, -(-h // p), -(-w // p)), vision_start, fps,
                                   float(config.base_fps), self.temporal,
                                   config.unified_3d_mrope_reset_spatial_ids)
        positions = torch.cat([text, vision], dim=1)
        cos, sin = self.rope.tables(positions, self.device)
        return JointLayout(input_ids, positions, cos, sin)

    # ---- the VAE ----

    def _latent_stats(self):
        config = self.vae.config
        dtype = self.vae.dtype
        mean = torch.tensor(config.latents_mean, dtype=dtype).view(1, -1, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(config.latents_std, dtype=dtype).view(1, -1, 1, 1, 1)
        return mean.to(self.device), inv_std.to(self.device)

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """[1, 3, F, H, W] in [-1, 1] -> normalised latents (float32), the mode of the
        posterior, as diffusers' pipeline encodes."""
        mean, inv_std = self._latent_stats()
        mu = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode()
        return ((mu - mean) * inv_std).float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (1, C, T, h, w) -> frames (F, H, W, 3) in [0, 1], float32."""
        mean, inv_std = self._latent_stats()
        z = latents.to(self.vae.dtype) / inv_std + mean
        return vae_frames(self.vae.decode(z).sample.float())


class VideoRequest:
    """A request's video settings with the model's defaults filled in."""

    def __init__(self, **values) -> None:
        self.__dict__.update(values)

    @classmethod
    def resolve(cls, params: VisualGenParams) -> VideoRequest:
        return cls(**with_defaults(params, DEFAULTS), negative_prompt=params.negative_prompt,
                   num_inference_steps=params.num_inference_steps)

    def with_metadata(self, text: str, negated: bool) -> str:
        """diffusers' duration and resolution sentences, appended after a period."""
        kind = "image" if self.num_frames == 1 else "video"
        no = "not " if negated else ""
        sentences = []
        if self.num_frames != 1:
            sentences.append(f"The video is {no}{self.num_frames / self.frame_rate:.1f} seconds "
                             f"long and is {no}of {self.frame_rate:.0f} FPS.")
        sentences.append(f"This {kind} is {no}of {self.height}x{self.width} resolution.")
        for sentence in sentences:
            base = text.rstrip(".")
            text = f"{base}. {sentence}" if base else sentence
        return text

