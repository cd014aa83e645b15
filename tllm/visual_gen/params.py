"""User-facing image generation parameters, validated once at the edge (the model-dependent
rules, such as the VAE's size multiple, are checked by the pipeline)."""
from __future__ import annotations

import math
from dataclasses import dataclass

SIZE_MULTIPLE = 16      # VAE downsampling (8) x latent patch (2) of the Qwen-Image family
MAX_SIZE = 4096         # per side; far past what the models were trained for
MAX_STEPS = 1000        # the scheduler's training timesteps
MAX_FRAMES = 1025       # per video; far past what the video models were trained for
MAX_FRAME_RATE = 240.0
LAYERED_RESOLUTIONS = (640, 1024)


@dataclass(frozen=True)
class VisualGenParams:
    """How to generate images for a prompt (names as in diffusers' Qwen-Image pipelines).

    height/width None: the model's default size (1024x1024 for Qwen-Image). Classifier-free
    guidance runs when `negative_prompt` is given and `true_cfg_scale` > 1 (one batched
    transformer forward per step). `guidance_scale` is only for guidance-distilled models.
    Image i of a request uses seed `seed + i`, so a batch equals separate runs. `layers`,
    `resolution` and `caption_language` are for the layered model (output size follows the
    input image there; an empty prompt is replaced by a caption of the image, written by the
    text encoder in this language: diffusers' `use_en_prompt`, whose default is Chinese).
    Video models (Cosmos 3, LTX-2) read `num_frames` and `frame_rate` (None: the model's
    defaults) and `guidance_scale` as their classifier-free guidance scale (1 disables it).
    LTX-2 (video with sound) also reads `audio_guidance_scale` (the sound's CFG scale),
    `modality_scale` (guidance away from a prediction without audio-video cross attention; 1
    disables it) and `guidance_rescale` (toward the unguided prediction's std; 0 disables
    it); None: the model's defaults, as in diffusers' LTX2Pipeline.
    `cache` ("teacache" or "first_block", step_cache.py) skips transformer steps whose input
    barely changed, reusing the last residual, while the accumulated relative change stays
    under `cache_threshold` (None: 0.2 for teacache, 0.1 for first_block; 0 never skips).
    """

    height: int | None = None
    width: int | None = None
    num_inference_steps: int = 50
    guidance_scale: float | None = None
    true_cfg_scale: float = 4.0
    negative_prompt: str | None = None
    cfg_normalize: bool | None = None
    seed: int | None = None
    num_images_per_prompt: int = 1
    layers: int | None = None
    resolution: int | None = None
    output_type: str = "pil"
    return_latents: bool = False
    caption_language: str = "en"
    num_frames: int | None = None
    frame_rate: float | None = None
    audio_guidance_scale: float | None = None
    modality_scale: float | None = None
    guidance_rescale: float | None = None
    cache: str | None = None
    cache_threshold: float | None = None

    def __post_init__(self) -> None:
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None:
                check(_is_int(value) and 0 < value <= MAX_SIZE and value % SIZE_MULTIPLE == 0,
                       name, value, f"must be a positive multiple of {SIZE_MULTIPLE} up to "
                       f"{MAX_SIZE}")
        check(_is_int(self.num_inference_steps) and 1 <= self.num_inference_steps <= MAX_STEPS,
               "num_inference_steps", self.num_inference_steps,
               f"must be an integer in [1, {MAX_STEPS}]")
        if self.guidance_scale is not None:
            check(_is_finite(self.guidance_scale) and self.guidance_scale >= 0,
                   "guidance_scale", self.guidance_scale, "must be a number >= 0")
        check(_is_finite(self.true_cfg_scale) and self.true_cfg_scale >= 1, "true_cfg_scale",
               self.true_cfg_scale, "must be a number >= 1 (1 disables guidance)")
        check(self.negative_prompt is None or isinstance(self.negative_prompt, str),
               "negative_prompt", self.negative_prompt, "must be a string")
        check(self.cfg_normalize is None or isinstance(self.cfg_normalize, bool),
               "cfg_normalize", self.cfg_normalize, "must be true, false or None")
        if self.seed is not None:
            check(_is_int(self.seed) and 0 <= self.seed < 2**63, "seed", self.seed,
                   "must be an integer in [0, 2**63)")
        check(_is_int(self.num_images_per_prompt) and self.num_images_per_prompt >= 1,
               "num_images_per_prompt", self.num_images_per_prompt, "must be an integer >= 1")
        if self.layers is not None:
            check(_is_int(self.layers) and 1 <= self.layers <= 16, "layers", self.layers,
                   "must be an integer in [1, 16]")
        if self.resolution is not None:
            check(self.resolution in LAYERED_RESOLUTIONS, "resolution", self.resolution,
                   f"must be one of {LAYERED_RESOLUTIONS}")
        check(self.output_type in ("pil", "latent"), "output_type", self.output_type,
               "must be 'pil' or 'latent'")
        check(isinstance(self.return_latents, bool), "return_latents", self.return_latents,
               "must be true or false")
        check(self.caption_language in ("en", "zh"), "caption_language",
               self.caption_language, "must be 'en' or 'zh'")
        if self.num_frames is not None:
            check(_is_int(self.num_frames) and 1 <= self.num_frames <= MAX_FRAMES, "num_frames",
                  self.num_frames, f"must be an integer in [1, {MAX_FRAMES}]")
        if self.frame_rate is not None:
            check(_is_finite(self.frame_rate) and 0 < self.frame_rate <= MAX_FRAME_RATE,
                  "frame_rate", self.frame_rate, f"must be a number in (0, {MAX_FRAME_RATE}]")
        for name in ("audio_guidance_scale", "modality_scale"):
            value = getattr(self, name)
            if value is not None:
                check(_is_finite(value) and value >= 1, name, value,
                      "must be a number >= 1 (1 disables it)")
        if self.guidance_rescale is not None:
            check(_is_finite(self.guidance_rescale) and 0 <= self.guidance_rescale <= 1,
                  "guidance_rescale", self.guidance_rescale, "must be a number in [0, 1]")

        check(self.cache in (None, "teacache", "first_block"), "cache", self.cache,
              "must be 'teacache', 'first_block' or None")
        if self.cache_threshold is not None:
            check(self.cache is not None, "cache_threshold", self.cache_threshold,
                  "needs a cache ('teacache' or 'first_block')")
            check(_is_finite(self.cache_threshold) and self.cache_threshold >= 0,
                  "cache_threshold", self.cache_threshold, "must be a number >= 0")

    @property
    def is_cfg(self) -> bool:
        """Whether classifier-free guidance runs (diffusers' rule: a negative prompt and a
        scale above 1)."""
        return self.negative_prompt is not None and self.true_cfg_scale > 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check(ok: bool, name: str, value, rule: str) -> None:
    """Raise VisualGenParams' ValueError, naming the field, unless ok (pipelines use it for
    their model-dependent rules)."""
    if not ok:
        raise ValueError(f"VisualGenParams.{name} {rule}, got {value!r}")
