"""Will a visual model fit: the bytes its weights take in the dtype it loads in (the parameter
counts of a dummy's shapes, or the tensors in a folder's checkpoint files) against the memory
free on the device, checked before anything is allocated. TLLM_SKIP_MEMORY_CHECK=1 (read here
only) or VisualGen(..., check_memory=False) loads it anyway."""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from tllm.device import available_memory
from tllm.loader.hf import CheckpointError

if TYPE_CHECKING:
    from tllm.visual_gen.registry import VisualModelSpec

logger = logging.getLogger(__name__)
SKIP_ENV = "TLLM_SKIP_MEMORY_CHECK"
NEAR_LIMIT = 0.8                # of the free memory: above it, warn (activations need room)
CPU_SLOW_BYTES = 2 * 1024 ** 3  # weights above this take a CPU minutes an image or more
QUICK_CPU_MODEL = "dummy:qwen-image-tiny"
_OTHER_WEIGHT_FILES = (".bin", ".pt", ".pth", ".ckpt")
_TRUE = ("1", "true", "yes", "on")


class ModelTooLargeError(ValueError):
    """A visual model whose weights need more memory than its device has free."""


def count_parameters(modules: Iterable[nn.Module]) -> int:
    return sum(p.numel() for module in modules for p in module.parameters())


def estimate_weight_bytes(spec: VisualModelSpec, dtype: torch.dtype) -> int:
    """The bytes a resolved model's weights take in `dtype`."""
    element_size = torch.empty((), dtype=dtype).element_size()
    if spec.dummy_preset is not None:
        return spec.pipeline_class().dummy_parameter_count(spec.dummy_preset) * element_size
    return folder_weight_bytes(spec.path, element_size)


def folder_weight_bytes(folder: Path, element_size: int) -> int:
    """The tensors of every safetensors file under `folder` (read from their headers) at
    `element_size` bytes an element, plus other weight files at their size on disk."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for file in sorted(folder.rglob("*")):
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), framework="pt") as f:
                    numel = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"corrupt or unreadable weight file {file}: {exc}"
                                      ) from None
            total += numel * element_size
        elif file.suffix in _OTHER_WEIGHT_FILES:
            total += file.stat().st_size
    return total


def check_fits(model: str, needed_bytes: int, device: torch.device) -> None:
    """Raise ModelTooLargeError if `needed_bytes` exceed the memory free on `device`; warn
    when they come near it, and when a CPU gets a model large enough to be very slow."""
    if os.environ.get(SKIP_ENV, "").lower() in _TRUE:
        return
    available = available_memory(device)
    if available is None:
        return
    where = "available RAM" if device.type == "cpu" else f"free memory on {device}"
    if needed_bytes > available:
        raise ModelTooLargeError(
            f"model {model!r} needs about {_gib(needed_bytes)} for its weights, more than the "
            f"{_gib(available)} of {where}; pick a smaller model or dtype ({QUICK_CPU_MODEL} "
            f"runs on a CPU in seconds), or set {SKIP_ENV}=1 (VisualGen(..., "
            "check_memory=False)) to load it anyway")
    if needed_bytes > NEAR_LIMIT * available:
        logger.warning("model %r needs about %s for its weights, %.0f%% of the %s of %s; "
                       "generating may run out of memory", model, _gib(needed_bytes),
                       100 * needed_bytes / available, _gib(available), where)
    if device.type == "cpu" and needed_bytes > CPU_SLOW_BYTES:
        logger.warning("model %r (about %s of weights) will be very slow on a CPU: minutes "
                       "an image or more (%s runs in seconds)", model, _gib(needed_bytes),
                       QUICK_CPU_MODEL)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 1024 ** 3:.1f} GiB"
