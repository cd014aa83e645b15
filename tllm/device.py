"""Which torch device to run on: what the user asked for, else CUDA when there is one."""
from __future__ import annotations

import torch


def pick_device(requested: str | None) -> torch.device:
    if requested is not None:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} asked for, but CUDA is not available")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
