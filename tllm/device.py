"""Which torch device to run on (what the user asked for, else CUDA when there is one), how
much memory it has free, and a CUDA graph's capture."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


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


def capture_cuda_graph(forward: Callable[[], T], pool,
                       stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, T]:
    """`forward` run twice on `stream` (kernels compiled, the allocator settled), then
    captured into a graph in memory pool `pool`: (the graph, what the captured call returned,
    which each replay rewrites in place)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out
