"""LTX-2's rotary positions: every video patch sits at the midpoint of the pixels it covers,
(seconds, row, column), time shifted back by the causal VAE's first frame; every audio latent
frame at the midpoint of the seconds it covers. Angles are fractions of a base extent (20 s,
2048 px) mapped to [-1, 1] and multiplied by theta**linspace(0, 1) * pi / 2, the axes
interleaved over the frequencies and the leftover pairs unrotated (angle 0) at the front, as
diffusers' `LTX2AudioVideoRotaryPosEmbed` computes them (float32, frequencies in float64 when
asked). One table row per token, one column per rotated pair; `split_chunks` says how the
pairs sit in the features (None: (2i, 2i + 1); n: per chunk of 2r features, (j, j + r))."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tllm.kernels.triton.ltx2_norms import apply_rope


@dataclass(frozen=True)
class RopeTable:
    cos: torch.Tensor               # [N, C / 2] float32
    sin: torch.Tensor
    split_chunks: int | None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, self.cos, self.sin, self.split_chunks)


def video_positions(num_frames: int, height: int, width: int, config, fps: float,
                    device=None) -> torch.Tensor:
    """[3, N] patch midpoints (seconds, pixel row, pixel column) of a latent video grid,
    frame-major as the packed tokens are."""
    p, pt = config.patch_size, config.patch_size_t
    axes = [torch.arange(0, n, step, dtype=torch.float32, device=device)
            for n, step in ((num_frames, pt), (height, p), (width, p))]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij")).flatten(1)      # [3, N]
    size = torch.tensor([pt, p, p], dtype=torch.float32, device=device)[:, None]
    scale = torch.tensor(config.vae_scale_factors, device=device)[:, None]
    start, end = grid * scale, (grid + size) * scale
    first = config.vae_scale_factors[0]
    for bound in (start, end):
        bound[0] = (bound[0] + config.causal_offset - first).clamp(min=0) / fps
    return (start + end) / 2.0


def audio_positions(num_frames: int, config, device=None) -> torch.Tensor:
    """[1, N] midpoints in seconds of the latent audio frames."""
    grid = torch.arange(0, num_frames, config.audio_patch_size_t, dtype=torch.float32,
                        device=device)
    factor = config.audio_scale_factor

    def seconds(frames: torch.Tensor) -> torch.Tensor:
        mel = (frames * factor + config.causal_offset - factor).clip(min=0)
        return mel * config.audio_hop_length / config.audio_sampling_rate

    return ((seconds(grid) + seconds(grid + config.audio_patch_size_t)) / 2.0)[None]


def rope_table(positions: torch.Tensor, max_positions: tuple[float, ...], dim: int,
               theta: float, double_precision: bool, split_chunks: int | None) -> RopeTable:
    """The table of `positions` [A, N] for a width of `dim` features."""
    num_axes = positions.shape[0]
    fractions = torch.stack([positions[i] / max_positions[i] for i in range(num_axes)], -1)
    freq_dtype = torch.float64 if double_precision else torch.float32
    steps = torch.linspace(0.0, 1.0, dim // (2 * num_axes), dtype=freq_dtype,
                           device=positions.device)
    freqs = (torch.pow(theta, steps) * math.pi / 2.0).to(torch.float32)
    angles = ((fractions[..., None] * 2 - 1) * freqs).transpose(-1, -2).flatten(1)
    padding = dim // 2 - angles.shape[1]
    cos, sin = angles.cos(), angles.sin()
    if padding:
        cos = torch.cat([torch.ones_like(cos[:, :padding]), cos], dim=1)
        sin = torch.cat([torch.zeros_like(sin[:, :padding]), sin], dim=1)
    return RopeTable(cos, sin, split_chunks)


@dataclass(frozen=True)
class LTX2Rope:
    """The four tables of one generation: video and audio self-attention, and the time-only
    ones of audio-video cross attention (queries and keys use their own stream's)."""
    video: RopeTable
    audio: RopeTable
    video_cross: RopeTable
    audio_cross: RopeTable
    video_positions: torch.Tensor       # [3, N_v], what the tables were built from
    audio_positions: torch.Tensor       # [1, N_a]

    @classmethod
    def build(cls, config, video_pos: torch.Tensor, audio_pos: torch.Tensor) -> LTX2Rope:
        split = config.rope_type == "split"
        theta, double = config.rope_theta, config.rope_double_precision
        cross_max = max(config.pos_embed_max_pos, config.audio_pos_embed_max_pos)
        video_max = (config.pos_embed_max_pos, config.base_height, config.base_width)
        cross_dim = config.audio_cross_attention_dim

        def chunks(heads: int) -> int | None:
            return heads if split else None

        heads, audio_heads = config.num_attention_heads, config.audio_num_attention_heads
        return cls(
            rope_table(video_pos, video_max, config.inner_dim, theta, double, chunks(heads)),
            rope_table(audio_pos, (config.audio_pos_embed_max_pos,), config.audio_inner_dim,
                       theta, double, chunks(audio_heads)),
            rope_table(video_pos[:1], (cross_max,), cross_dim, theta, double, chunks(heads)),
            rope_table(audio_pos, (cross_max,), cross_dim, theta, double, chunks(audio_heads)),
            video_pos, audio_pos)
