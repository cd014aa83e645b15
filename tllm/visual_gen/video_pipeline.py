"""What the video pipelines (Cosmos 3, LTX-2) share around their denoising: a request's
settings with the model's defaults filled in and checked against the VAE's compression, the
latent grid that compression gives, a video (and soundtrack) per seed in generate(), and the
VAE's output as uint8 frames.

A model's video pipeline says how to resolve its request, and how one seed's video is made
(`sample`): the prompt's encoding, the latents' noise and the decoding stay the model's own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from tllm.visual_gen.params import VisualGenParams, check
from tllm.visual_gen.pipeline import DenoiseHook, VisualGenOutput, VisualPipeline, image_seeds


@dataclass(frozen=True)
class VideoSample:
    """One seed's video: its final latents (as generate() returns them) and, unless only
    latents were asked for, its frames (uint8 (F, H, W, 3)) and soundtrack ((channels,
    samples), float)."""

    latents: torch.Tensor
    frames: np.ndarray | None = None
    audio: torch.Tensor | None = None


class VideoPipeline(VisualPipeline):
    """A text/image-to-video pipeline: a video per seed, frames packed by the VAE `temporal`
    to a latent frame and `spatial` pixels to a latent pixel each way."""

    makes_video = True
    takes_image = False         # an image is optional (image-to-video) unless a subclass says
    defaults: dict[str, float]  # the model's num_frames, height, width, frame_rate, scales...
    vae: nn.Module
    spatial: int
    temporal: int
    size_multiple: int          # what height and width must be multiples of
    sample_rate: int | None = None  # of the soundtrack, for models that make one

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    def resolve(self, params: VisualGenParams) -> Any:
        """The request's settings (num_frames, height, width, frame_rate, ...) with the
        model's defaults filled in."""
        raise NotImplementedError

    def sample(self, prompt: str, request: Any, seed: int, image: Any | None,
               hooks: Sequence[DenoiseHook], decode: bool) -> VideoSample:
        """One video from one seed; its frames (and sound) decoded when `decode`."""
        raise NotImplementedError

    # ---- requests ----

    def check_request(self, params: VisualGenParams, images, prompts) -> None:
        if images is not None and len(images) not in (1, len(prompts)):
            raise ValueError("image: give one input image, or one per prompt")
        if self.takes_image and images is None:
            raise ValueError("image: this image-to-video model needs an input image")
        num_frames = params.num_frames
        check(num_frames is None or num_frames % self.temporal == 1, "num_frames", num_frames,
              f"must be {self.temporal} * k + 1 for this model (its VAE packs "
              f"{self.temporal} frames into one latent frame)")
        for name in ("height", "width"):
            value = getattr(params, name)
            check(value is None or value % self.size_multiple == 0, name, value,
                  f"must be a multiple of {self.size_multiple} for this model")
        for name in ("layers", "resolution"):
            check(getattr(params, name) is None, name, getattr(params, name),
                  "is for layered models only")

    def frames_for_duration(self, seconds: float, frame_rate: float | None) -> int:
        """temporal * k + 1 frames lasting about `seconds` at the frame rate."""
        rate = frame_rate or self.defaults["frame_rate"]
        return self.temporal * max(1, round(seconds * rate / self.temporal)) + 1

    def latent_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The VAE's latent (frames, rows, columns) for a video of this size."""
        return ((num_frames - 1) // self.temporal + 1, height // self.spatial,
                width // self.spatial)

    # ---- generation ----

    @torch.no_grad()
    def generate(self, prompts: list[str], params: VisualGenParams,
                 images: Sequence[Any] | None = None,
                 hooks: Sequence[DenoiseHook] = ()) -> VisualGenOutput:
        self.check_request(params, images, prompts)
        request = self.resolve(params)
        per_prompt = params.num_images_per_prompt
        seeds = image_seeds(params.seed, len(prompts) * per_prompt)
        decode = params.output_type != "latent"
        samples = []
        for index, seed in enumerate(seeds):
            image = None if images is None else images[min(index // per_prompt,
                                                            len(images) - 1)]
            samples.append(self.sample(prompts[index // per_prompt], request, seed, image,
                                       hooks, decode))
        keep = params.return_latents or not decode
        return VisualGenOutput(
            [], torch.cat([s.latents for s in samples]) if keep else None, seeds,
            videos=[s.frames for s in samples if s.frames is not None],
            frame_rate=request.frame_rate,
            audio=[s.audio for s in samples if s.audio is not None] or None,
            sample_rate=self.sample_rate)


def with_defaults(params: VisualGenParams, defaults: dict[str, float]) -> dict[str, Any]:
    """The params' values of the defaults' names, a default where a value was not given."""
    return {name: getattr(params, name) if getattr(params, name) is not None else default
            for name, default in defaults.items()}


def vae_frames(video: torch.Tensor) -> torch.Tensor:
    """A VAE's decoded (1, 3, F, H, W) in [-1, 1] -> frames (F, H, W, 3) in [0, 1]."""
    return (video[0] / 2 + 0.5).clamp(0, 1).permute(1, 2, 3, 0)


def to_uint8(frames: torch.Tensor) -> np.ndarray:
    """Frames in [0, 1] as uint8, rounded as diffusers rounds its PIL frames."""
    return (frames.cpu().numpy() * 255).round().astype(np.uint8)
