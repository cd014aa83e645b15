"""Flow-matching Euler sampling with resolution-dependent ("dynamic") time shift, as Qwen-Image
uses it; sigmas and timesteps equal diffusers' FlowMatchEulerDiscreteScheduler bit for bit.

The arithmetic is done in numpy with diffusers' dtypes and operation order on purpose:
float32 sigmas given by the pipeline stay float32, the default linspace is float64, and both
are cast to float32 at the end.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

# Options of diffusers' scheduler that change the schedule and that we do not implement.
_UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                "invert_sigmas", "stochastic_sampling")


@dataclass(frozen=True)
class FlowMatchConfig:
    """The fields of diffusers' scheduler_config.json that matter, with diffusers' defaults
    (so a file that leaves one out means what it means to diffusers)."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    shift_terminal: float | None = None
    time_shift_type: str = "exponential"

    def __post_init__(self) -> None:
        if self.time_shift_type not in ("exponential", "linear"):
            raise ValueError(f"scheduler time_shift_type must be 'exponential' or 'linear', "
                             f"got {self.time_shift_type!r}")

    @classmethod
    def from_dict(cls, data: dict) -> FlowMatchConfig:
        unsupported = [name for name in _UNSUPPORTED if data.get(name)]
        if unsupported:
            raise ValueError(f"scheduler options not supported: {', '.join(unsupported)}")
        names = {f.name for f in fields(cls)}
        # null means "the default" in diffusers' files, except for shift_terminal (off)
        return cls(**{k: v for k, v in data.items()
                      if k in names and (v is not None or k == "shift_terminal")})

    @classmethod
    def from_model_dir(cls, path: str | Path, default: FlowMatchConfig) -> FlowMatchConfig:
        """The model folder's scheduler/scheduler_config.json, or `default` without one."""
        file = Path(path) / "scheduler" / "scheduler_config.json"
        if not file.is_file():
            return default
        return cls.from_dict(json.loads(file.read_text()))


# Qwen-Image's (and Qwen-Image-Layered's) scheduler_config.json.
QWEN_IMAGE_SCHEDULER = FlowMatchConfig(
    use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
    max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")


def calculate_shift(image_seq_len: int, config: FlowMatchConfig) -> float:
    """mu of the time shift: linear in the image's token count, from base_shift at
    base_image_seq_len to max_shift at max_image_seq_len."""
    slope = (config.max_shift - config.base_shift) / (
        config.max_image_seq_len - config.base_image_seq_len)
    intercept = config.base_shift - slope * config.base_image_seq_len
    return image_seq_len * slope + intercept


class FlowMatchEulerScheduler:
    """Sigmas from 1 (noise) down to 0; each step moves the sample along the predicted
    velocity: x <- x + (sigma_next - sigma) * v."""

    def __init__(self, config: FlowMatchConfig) -> None:
        self.config = config
        self.sigmas: torch.Tensor | None = None      # (num_steps + 1,), ends with 0
        self.timesteps: torch.Tensor | None = None   # (num_steps,), sigmas * 1000

    @property
    def num_steps(self) -> int:
        return 0 if self.timesteps is None else len(self.timesteps)

    def set_timesteps(self, num_steps: int, mu: float | None = None,
                      sigmas: np.ndarray | list[float] | None = None,
                      device: torch.device | str | None = None) -> None:
        """The schedule for num_steps steps; `mu` is required with dynamic shifting.
        `sigmas` are the unshifted ones (pipelines pass theirs, e.g. linspace(1, 1/n, n));
        without them, linspace over the training range as diffusers does."""
        if self.config.use_dynamic_shifting and mu is None:
            raise ValueError("mu is required: the scheduler uses dynamic shifting")
        if sigmas is None:
            sigma_max, sigma_min = self._training_sigma_range()
            num_train = self.config.num_train_timesteps
            base = np.linspace(sigma_max * num_train, sigma_min * num_train, num_steps) / num_train
        else:
            base = np.asarray(sigmas).astype(np.float32)
            if len(base) != num_steps:
                raise ValueError(f"got {len(base)} sigmas for {num_steps} steps")
        shifted = self._stretch_to_terminal(self._shift(base, mu))
        sigmas_t = torch.from_numpy(np.asarray(shifted)).to(dtype=torch.float32, device=device)
        self.timesteps = sigmas_t * self.config.num_train_timesteps
        self.sigmas = torch.cat([sigmas_t, torch.zeros(1, device=sigmas_t.device)])

    def step(self, model_output: torch.Tensor, step_index: int,
             sample: torch.Tensor) -> torch.Tensor:
        """The sample after step `step_index`, in model_output's dtype (the update itself is
        done in float32)."""
        dt = self.sigmas[step_index + 1] - self.sigmas[step_index]
        return (sample.to(torch.float32) + dt * model_output).to(model_output.dtype)

    def _training_sigma_range(self) -> tuple[float, float]:
        num_train = self.config.num_train_timesteps
        train = np.linspace(1, num_train, num_train, dtype=np.float32)[::-1] / np.float32(num_train)
        if not self.config.use_dynamic_shifting:
            train = self._static_shift(train)
        return float(train[0]), float(train[-1])

    def _shift(self, sigmas: np.ndarray, mu: float | None) -> np.ndarray:
        if not self.config.use_dynamic_shifting:
            return self._static_shift(sigmas)
        odds = 1 / sigmas - 1
        if self.config.time_shift_type == "exponential":
            return math.exp(mu) / (math.exp(mu) + odds)
        return mu / (mu + odds)

    def _static_shift(self, sigmas: np.ndarray) -> np.ndarray:
        shift = self.config.shift
        return shift * sigmas / (1 + (shift - 1) * sigmas)

    def _stretch_to_terminal(self, sigmas: np.ndarray) -> np.ndarray:
        """Rescale 1 - sigma so that the last sigma is shift_terminal. A one-step schedule
        ([1]) has nothing to stretch (diffusers divides 0 by 0 there and gets NaN)."""
        terminal = self.config.shift_terminal
        one_minus = 1 - sigmas
        if not terminal or one_minus[-1] == 0:
            return sigmas
        scale = one_minus[-1] / (1 - terminal)
        return 1 - (one_minus / scale)
