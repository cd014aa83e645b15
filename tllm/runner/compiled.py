"""Decode graphs captured from a torch.compile'd model (cuda_graph_config.torch_compile):
Inductor fuses the plain-PyTorch code between our kernels, which the layers hand it as torch
custom ops (tllm/kernels/custom_ops.py) while it traces. Off by default.

Each captured batch size is traced once with static shapes (the decode step's shapes are
fixed per graph, and static shapes give the compiler the most to fuse); Inductor's on-disk
caches (FX graphs, autotuning) make a later process with the same model and sizes compile
much faster. Only graph capture calls the compiled functions: replays run no Python."""
from __future__ import annotations

import torch
from torch import nn

# one trace per captured batch size (256 sizes at most), not Dynamo's default of 8
_RECOMPILE_LIMIT = 256


class CompiledDecodeModel:
    """Stands in for the model in CudaGraphRunner: forward and compute_logits compiled."""

    def __init__(self, model: nn.Module) -> None:
        from tllm.kernels import custom_ops  # noqa: F401  (registers torch.ops.tllm.*)
        # Dynamo's cache keys on the forward's code and its inputs' shapes, not on the
        # settings that chose kernels while it traced (the dense GEMV's, say): an earlier
        # engine's traces in this process must not be replayed for this one.
        torch._dynamo.reset()
        self.model = model
        self._forward = torch.compile(model.forward, dynamic=False)
        self._logits = torch.compile(model.compute_logits, dynamic=False)

    def __call__(self, input_ids, kv_caches, metadata) -> torch.Tensor:
        with _recompile_limit():
            return self._forward(input_ids, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with _recompile_limit():
            return self._logits(hidden)


def _recompile_limit():
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch({name: _RECOMPILE_LIMIT})
