"""Which torch device to run on (what the user asked for, else CUDA when there is one), and
how much memory it has free."""
from __future__ import annotations

import torch


def pick_device(requested: str | None) -> torch.device:
    if requested is not None:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} asked for, but CUDA is not available")
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation can take on `device`: free memory on a GPU, available RAM on
    the CPU; None for other device types."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        import psutil
        return psutil.virtual_memory().available
    return None
