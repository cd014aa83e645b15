"""Cosmos 3's joint sequence and its 3D positions: the prompt's tokens first (the same position
on all three axes, counting up), then after a margin the video's patches at (time, row,
column), with time scaled to the base frame rate when fps modulation is on, then the sound's
frames (their own time axis, starting where the video's does).

The rotary angles interleave the axes over the frequencies as diffusers'
`Cosmos3VLTextRotaryEmbedding` does ("mrope interleaved": frequency i takes the row axis when
i % 3 == 1 and i < 3 * rows, the column axis when i % 3 == 2 and i < 3 * columns, else
time); the tables hold one (cos, sin) per rotated pair (i, i + D/2): [tokens, D/2] float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def text_positions(num_tokens: int, start: float, as_float: bool) -> torch.Tensor:
    """[3, n]: start, start + 1, ... on every axis."""
    ids = torch.arange(num_tokens, dtype=torch.float32 if as_float else torch.long) + (
        start if as_float else int(start))
    return ids.unsqueeze(0).expand(3, -1)


def grid_positions(grid: tuple[int, int, int], start: float, fps: float | None,
                   base_fps: float, temporal_compression: int,
                   reset_spatial: bool = True) -> tuple[torch.Tensor, int]:
    """[3, t * h * w] positions of a latent grid, and the next free temporal position. With
    fps (and more than one frame) time runs in units of the base frame rate's latent frames."""
    t, h, w = grid
    modulated = fps is not None and t > 1
    if modulated:
        scaled = torch.arange(t, dtype=torch.float32) / (fps / temporal_compression) * (
            base_fps / temporal_compression) + start
        time = scaled.view(-1, 1).expand(-1, h * w).flatten()
    else:
        time = (torch.arange(t).view(-1, 1).expand(-1, h * w).flatten() + int(start))
    rows = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
    cols = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
    if not reset_spatial:
        rows, cols = rows + int(start), cols + int(start)
    if modulated:
        positions = torch.stack([time, rows.float(), cols.float()])
    else:
        positions = torch.stack([time, rows, cols])
    return positions, math.ceil(positions.max().item()) + 1


@dataclass
class JointLayout:
    """One guidance branch's joint sequence: its prompt tokens (the first und_len positions)
    and the rotary tables of the whole sequence, prompt then generation tokens."""
    input_ids: torch.Tensor     # [und_len] long
    positions: torch.Tensor     # [3, und_len + gen tokens], float with fps modulation
    cos: torch.Tensor           # [und_len + gen tokens, head_dim / 2] float32
    sin: torch.Tensor

    @property
    def und_len(self) -> int:
        return self.input_ids.shape[0]


class MultimodalRope:
    """Rotary tables for [3, S] positions, frequencies interleaved over the axes."""

    def __init__(self, head_dim: int, theta: float, axes: tuple[int, int, int]) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                         / head_dim))
        self.axes = axes

    def tables(self, positions: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, :, None] * self.inv_freq[None, None, :]   # [3, S, D/2]
        angles = freqs[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            index = slice(offset, self.axes[axis] * 3, 3)
            angles[:, index] = freqs[axis][:, index]
        return angles.cos().to(device), angles.sin().to(device)
