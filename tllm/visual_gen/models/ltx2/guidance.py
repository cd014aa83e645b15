"""LTX-2's guidance, as diffusers' LTX2Pipeline applies it to each stream: the branches'
velocities become denoised estimates x0 = x - sigma * v; classifier-free guidance (scale g,
branches [uncond, cond]) and modality guidance (scale m, a branch with the audio-video cross
attention off) move the cond estimate, x0 = c + (g - 1)(c - u) + (m - 1)(c - i); the result
is rescaled toward the cond estimate's standard deviation (factor r) and turned back into a
velocity. Video and audio have their own scales.

diffusers also runs spatio-temporal guidance (STG), a branch whose self-attention is skipped
in some blocks; LTX-2.0's transformer has no perturbed attention, so that branch equals the
cond one (its term is zero) and it is not run here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tllm.visual_gen.pipeline import DenoiseStep, StreamGuidance


@dataclass(frozen=True)
class StreamScales:
    cfg: float = 1.0            # classifier-free guidance (1: off)
    modality: float = 1.0       # modality isolation guidance (1: off)
    rescale: float = 0.0        # guidance rescale toward the cond std (0: off)


class LTX2Guidance(StreamGuidance):
    """Branches, in the order the pipeline batches them: [uncond] if CFG runs for either
    stream, cond, [isolated] if modality guidance runs for either stream."""

    def __init__(self, scales: dict[str, StreamScales], sigmas: torch.Tensor) -> None:
        self.scales = scales
        self.sigmas = sigmas
        self.has_uncond = any(s.cfg > 1 for s in scales.values())
        self.has_isolated = any(s.modality > 1 for s in scales.values())

    @property
    def num_branches(self) -> int:
        return 1 + self.has_uncond + self.has_isolated

    @property
    def cond_index(self) -> int:
        return int(self.has_uncond)

    def combine_stream(self, name: str, branches: Sequence[torch.Tensor],
                       step: DenoiseStep) -> torch.Tensor:
        sample, sigma = step.streams[name], self.sigmas[step.index]
        scales = self.scales[name]
        estimates = [sample - b.float() * sigma for b in branches]
        cond = estimates[self.cond_index]
        guided = cond
        if self.has_uncond:
            guided = guided + (scales.cfg - 1) * (cond - estimates[0])
        if self.has_isolated:
            guided = guided + (scales.modality - 1) * (cond - estimates[-1])
        if scales.rescale > 0:
            guided = rescale(guided, cond, scales.rescale)
        return (sample - guided) / sigma


def rescale(guided: torch.Tensor, cond: torch.Tensor, factor: float) -> torch.Tensor:
    """diffusers' rescale_noise_cfg: mix the guided estimate with itself scaled to the cond
    estimate's standard deviation (per batch row)."""
    dims = list(range(1, guided.ndim))
    matched = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return factor * matched + (1 - factor) * guided
