"""Visual-generation model families, one package each."""
from __future__ import annotations

import torch
from torch import nn


def to_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module` in `dtype`, skipping a cast that changes nothing (diffusers' models warn at
    every .to(dtype))."""
    return module if module.dtype == dtype else module.to(dtype)
