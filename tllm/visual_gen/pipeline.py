"""What every visual-generation pipeline shares: the denoising loop (one or several latent
streams, e.g. video and audio, moved by one scheduler step each and guided by one rule per
step, with hooks around each step), classifier-free guidance, seeded initial noise, and the
pipeline's output.

A model's pipeline (models/<family>/pipeline.py) encodes prompts, prepares latents, says how to
predict every stream's velocity for each guidance branch, and decodes; the loop below knows
nothing about the model.
"""
from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from tllm.visual_gen.params import VisualGenParams
from tllm.visual_gen.schedulers import FlowMatchEulerScheduler


@dataclass
class TextEmbeds:
    """Text-encoder states per image, unpadded ((L_i, D) each): the prompt's, and with
    classifier-free guidance the negative prompt's."""

    cond: list[torch.Tensor]
    uncond: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class Guidance:
    """How predictions are guided. With uncond embeddings and true_cfg_scale > 1:
    uncond + scale * (cond - uncond), rescaled to cond's norm per token when `normalize`.
    `distilled_scale` is fed to guidance-distilled transformers instead."""

    true_cfg_scale: float = 1.0
    normalize: bool = True
    distilled_scale: float | None = None


@dataclass
class ModelInputs:
    """The transformer's inputs besides latents, text and timestep, for one image."""

    img_shapes: list[tuple[int, int, int]]          # (frames, h, w) of each latent stream
    image_latents: torch.Tensor | None = None       # (N, S', C): appended, never denoised
    additional_t_cond: torch.Tensor | None = None   # (N,) extra timestep condition


@dataclass
class DenoiseStep:
    """One step of the loop, as hooks see it: `streams` are the step's input latents (by stream
    name, e.g. "video" and "audio") in prepare() and its result in update() (a hook may
    replace them); `latents` is the first stream; `model_kwargs` are the transformer's keyword
    arguments for this step (a hook may add to them)."""

    index: int
    num_steps: int
    timestep: torch.Tensor
    streams: dict[str, torch.Tensor]
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def latents(self) -> torch.Tensor:
        return next(iter(self.streams.values()))

    @latents.setter
    def latents(self, value: torch.Tensor) -> None:
        self.streams = {**self.streams, next(iter(self.streams)): value}


class StreamScheduler(Protocol):
    """What the loop needs of a scheduler: the timesteps and one update per step."""

    timesteps: torch.Tensor

    @property
    def num_steps(self) -> int: ...

    def step(self, model_output: torch.Tensor, step_index: int,
             sample: torch.Tensor) -> torch.Tensor: ...


class GuidanceRule(Protocol):
    """How one step's predictions of a stream, one per guidance branch, become its velocity."""

    @property
    def num_branches(self) -> int: ...

    def combine(self, branches: Sequence[torch.Tensor]) -> torch.Tensor: ...


class StreamGuidance:
    """A guidance rule whose combination depends on the stream and the step (per-stream
    scales, guidance of the denoised estimate rather than of the velocity, ...)."""

    @property
    def num_branches(self) -> int:
        raise NotImplementedError

    def combine_stream(self, name: str, branches: Sequence[torch.Tensor],
                       step: DenoiseStep) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class ClassifierFreeGuidance:
    """Branches [uncond, cond]: uncond + scale * (cond - uncond), rescaled to cond's norm per
    token when `normalize` (Qwen-Image's true CFG); one branch (cond) when scale is 1."""

    scale: float = 1.0
    normalize: bool = False
    in_float32: bool = False    # combine in float32 (Cosmos upcasts its predictions first)

    @property
    def num_branches(self) -> int:
        return 2 if self.scale != 1 else 1

    def combine(self, branches: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.in_float32:
            branches = [b.float() for b in branches]
        if len(branches) == 1:
            return branches[0]
        return guide(*branches, Guidance(self.scale, self.normalize))


class DenoiseHook:
    """Something that joins the loop: prepared before each transformer forward, updated after
    each scheduler step, freed when the loop ends (also on error). The loop knows nothing
    else about it."""

    def prepare(self, step: DenoiseStep) -> None:
        pass

    def update(self, step: DenoiseStep) -> None:
        pass

    def free(self) -> None:
        pass


class ProgressBar(DenoiseHook):
    """A tqdm bar over the steps."""

    def __init__(self, num_steps: int, disable: bool = False) -> None:
        self.bar = tqdm(total=num_steps, desc="denoising", unit="step", disable=disable)

    def update(self, step: DenoiseStep) -> None:
        self.bar.update(1)

    def free(self) -> None:
        self.bar.close()


class GenerationCancelled(Exception):
    """Raised out of generate() when its Cancellation was set."""


class Cancellation(DenoiseHook):
    """Stops a generation from another thread: once abort() is called, the next step raises
    GenerationCancelled (the step already running finishes first). Pass it in `hooks`; call
    check() to give up before the loop (e.g. before encoding prompts)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def abort(self) -> None:
        self._event.set()

    @property
    def aborted(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self.aborted:
            raise GenerationCancelled("the generation was cancelled")

    def prepare(self, step: DenoiseStep) -> None:
        self.check()


@dataclass
class VisualGenOutput:
    """Generated images, prompt-major (num_images_per_prompt per prompt): PIL images, or for
    a layered model one list of RGBA layers per image; `latents` when asked for (packed, as
    the transformer sees them); the seed each image used. Video models fill `videos` instead
    (one uint8 array (frames, H, W, 3) each, played at `frame_rate`) and, with sound,
    `audio` (one float waveform (channels, samples) in [-1, 1] each, at `sample_rate`).
    With step caching, `steps_skipped` says how many transformer steps each one skipped."""

    images: list[Any]
    latents: torch.Tensor | None
    seeds: list[int]
    videos: list[Any] | None = None
    frame_rate: float | None = None
    audio: list[torch.Tensor] | None = None
    sample_rate: int | None = None
    steps_skipped: list[int] | None = None


class VisualPipeline:
    """A model's pipeline: components plus the shared denoising loop."""

    transformer: nn.Module
    show_progress: bool = True
    takes_image: bool = False       # whether generate() needs input images

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @classmethod
    def dummy_parameter_count(cls, name: str) -> int:
        """The parameters of dummy model `name` (for the memory check), allocating none."""
        raise NotImplementedError

    def generate(self, prompts: list[str], params: VisualGenParams,
                 images: Sequence[Any] | None = None,
                 hooks: Sequence[DenoiseHook] = ()) -> VisualGenOutput:
        raise NotImplementedError

    @torch.no_grad()
    def denoise(self, latents: torch.Tensor, scheduler: FlowMatchEulerScheduler,
                embeds: TextEmbeds, guidance: Guidance, inputs: ModelInputs,
                hooks: Sequence[DenoiseHook] = ()) -> torch.Tensor:
        """Every step of `scheduler` on one stream of packed latents (N, S, C); returns the
        final ones.

        With guidance, the uncond and cond halves go through the transformer as one batch
        [uncond, cond] (text padded to the longer prompt, padding masked out)."""
        is_cfg = embeds.uncond is not None and guidance.true_cfg_scale > 1
        text = embeds.uncond + embeds.cond if is_cfg else embeds.cond
        num_copies = 2 if is_cfg else 1
        model_kwargs = self._constant_model_kwargs(text, guidance, inputs, num_copies, latents)
        rule = ClassifierFreeGuidance(guidance.true_cfg_scale if is_cfg else 1.0,
                                      guidance.normalize)

        def predict(step: DenoiseStep) -> dict[str, list[torch.Tensor]]:
            return {"latents": list(self._predict(step, inputs, num_copies).chunk(num_copies))}

        streams = denoise_streams({"latents": latents}, {"latents": scheduler}, predict, rule,
                                  hooks, self.show_progress, model_kwargs)
        return streams["latents"]

    def _constant_model_kwargs(self, text: list[torch.Tensor], guidance: Guidance,
                               inputs: ModelInputs, num_copies: int,
                               latents: torch.Tensor) -> dict[str, Any]:
        batch_size = latents.shape[0] * num_copies
        text_states, text_mask = pad_text(text)
        kwargs: dict[str, Any] = {
            "encoder_hidden_states": text_states,
            "encoder_hidden_states_mask": text_mask,
            "img_shapes": [inputs.img_shapes] * batch_size,
            "guidance": None,
            "additional_t_cond": None,
        }
        if guidance.distilled_scale is not None:
            kwargs["guidance"] = torch.full((batch_size,), guidance.distilled_scale,
                                            device=latents.device, dtype=torch.float32)
        if inputs.additional_t_cond is not None:
            kwargs["additional_t_cond"] = inputs.additional_t_cond.repeat(num_copies)
        return kwargs

    def _predict(self, step: DenoiseStep, inputs: ModelInputs,
                 num_copies: int) -> torch.Tensor:
        latents = step.latents
        hidden = latents if inputs.image_latents is None else torch.cat(
            [latents, inputs.image_latents], dim=1)
        hidden = hidden.repeat(num_copies, 1, 1)
        timestep = step.timestep.expand(hidden.shape[0]).to(latents.dtype) / 1000
        out = self.transformer(hidden_states=hidden, timestep=timestep, **step.model_kwargs)
        return out[:, :latents.shape[1]]


PredictFn = Callable[[DenoiseStep], dict[str, Sequence[torch.Tensor]]]


@torch.no_grad()
def denoise_streams(streams: dict[str, torch.Tensor],
                    schedulers: dict[str, StreamScheduler], predict: PredictFn,
                    guidance: GuidanceRule | StreamGuidance,
                    hooks: Sequence[DenoiseHook] = (),
                    show_progress: bool = False,
                    model_kwargs: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The denoising loop over several latent streams sharing one schedule: each step,
    `predict` gives every stream's prediction per guidance branch (one forward of the
    model for all of them, as the model likes), `guidance` combines each stream's branches,
    and that stream's scheduler moves it. Returns the final latents by stream."""
    if set(streams) != set(schedulers):
        raise ValueError(f"streams {sorted(streams)} and schedulers {sorted(schedulers)} differ")
    clock = next(iter(schedulers.values()))
    hooks = [ProgressBar(clock.num_steps, disable=not show_progress), *hooks]
    try:
        for index, timestep in enumerate(clock.timesteps):
            step = DenoiseStep(index, clock.num_steps, timestep, dict(streams),
                               dict(model_kwargs or {}))
            for hook in hooks:
                hook.prepare(step)
            branches = predict(step)
            step.streams = {
                name: schedulers[name].step(_combine(guidance, name, branches[name], step),
                                            index, sample)
                for name, sample in step.streams.items()}
            for hook in hooks:
                hook.update(step)
            streams = step.streams
    finally:
        for hook in hooks:
            hook.free()
    return streams


def _combine(guidance: GuidanceRule | StreamGuidance, name: str,
             branches: Sequence[torch.Tensor], step: DenoiseStep) -> torch.Tensor:
    if isinstance(guidance, StreamGuidance):
        return guidance.combine_stream(name, branches, step)
    return guidance.combine(branches)


def guide(uncond: torch.Tensor, cond: torch.Tensor, guidance: Guidance) -> torch.Tensor:
    """Classifier-free guidance of one step's predictions (diffusers' true CFG)."""
    combined = uncond + guidance.true_cfg_scale * (cond - uncond)
    if not guidance.normalize:
        return combined
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    combined_norm = torch.norm(combined, dim=-1, keepdim=True)
    return combined * (cond_norm / combined_norm)


def pad_text(states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, L, D) states zero-padded to the longest, and the (B, L) validity mask (None when
    nothing is padded, so the transformer can skip masking)."""
    lengths = [s.shape[0] for s in states]
    longest = max(lengths)
    padded = torch.stack([torch.cat([s, s.new_zeros(longest - len(s), s.shape[1])])
                          for s in states])
    if min(lengths) == longest:
        return padded, None
    positions = torch.arange(longest, device=padded.device)
    mask = positions[None, :] < torch.tensor(lengths, device=padded.device)[:, None]
    return padded, mask.long()


def initial_noise(shape: tuple[int, ...], seeds: list[int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """Gaussian noise (len(seeds), *shape), image i drawn from a CPU generator seeded with
    seeds[i]: diffusers' randn_tensor with a list of CPU generators, so the same seed gives
    the same noise on any device and in any batch."""
    noise = [torch.randn((1, *shape), generator=torch.Generator("cpu").manual_seed(seed),
                         dtype=dtype) for seed in seeds]
    return torch.cat(noise).to(device)


def image_seeds(seed: int | None, num_images: int) -> list[int]:
    """seed, seed + 1, ... (a random start when seed is None)."""
    if seed is None:
        seed = secrets.randbelow(2**62)
    return [seed + i for i in range(num_images)]


def to_pil(images: torch.Tensor) -> list[Any]:
    """Images (N, C, H, W) in [0, 1] as PIL images (RGB, or RGBA for 4 channels), rounded to
    8 bits as diffusers rounds them."""
    from PIL import Image

    array = images.permute(0, 2, 3, 1).float().cpu().numpy()
    array = (array * 255).round().astype("uint8")
    return [Image.fromarray(image) for image in array]     # (H, W, 3|4) uint8: RGB or RGBA
