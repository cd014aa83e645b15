"""New weights into a built model without rebuilding it (RL rollouts): the checkpoint's
names and each model's own `load_weights` mapping and sharding, then each layer's
quantization method's `process_after_loading`, as at load time.

Every parameter keeps its storage (CUDA graphs captured over it stay valid): a method whose
run-time form differs from the checkpoint's (FP8 quantized at load) gets its checkpoint form
back for the update (the current weight, dequantized, so that a partial update of a merged
q/k/v layer keeps the other shards), is loaded, converted again, and the result copied into
the old run-time tensors."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from tllm.layers.linear import Linear
from tllm.layers.moe import UnquantizedMoEMethod
from tllm.layers.quant.base import UnquantizedMethod, add_param
from tllm.layers.quant.fp8 import Fp8LinearMethod
from tllm.loader.hf import CheckpointError, iter_weights, weight_files

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def update_model_weights(model: nn.Module, weights: NamedTensors,
                         dtype: torch.dtype) -> set[str]:
    """Copy (HF name, full tensor) pairs into `model` (this rank's shards), converted as at
    load; returns the keys `model.load_weights` reports. ValueError for a name the model has
    no place for, a wrong shape, or a layer whose quantization cannot be updated in place;
    the model is unchanged by a name refused up front but may hold part of an update that
    failed half way (a partial update; send the rest again)."""
    check_updatable(model)
    staged = [_StagedLayer(item, dtype) for item in _reloaded_layers(model)]
    device = _model_device(model)
    loaded: set[str] = set()
    try:
        loaded = model.load_weights((name, _as_tensor(name, t, device)) for name, t in weights)
    finally:  # even a failed update leaves every layer in its run-time form
        touched = _touched_modules(loaded)
        for stage in staged:
            stage.finish(stage.name in touched)
    return loaded


def check_updatable(model: nn.Module) -> None:
    """ValueError if a layer's quantization converts its weights after loading in a way
    an update cannot redo (weight-only int4/int8, GGUF blocks, AWQ/GPTQ, fp8 checkpoints
    with per-tensor or static scales)."""
    for name, module in model.named_modules():
        quant = getattr(module, "quant", None)
        if quant is not None and not _is_updatable(_base_method(quant)):
            scheme = getattr(quant, "name", type(quant).__name__)
        elif quant is None and hasattr(module, "process_after_loading"):
            scheme = type(module).__name__     # a quantized embedding or LM head
        else:
            continue
        raise ValueError(f"update_weights: layer {name!r} is quantized ({scheme!r}): its "
                         "weights cannot be updated in place (serve the model unquantized, "
                         "or FP8 quantized at load)")


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an HF model folder's safetensors (or .bin) files."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"update_weights_from_disk: {str(path)!r} is not a folder of "
                              "safetensors files")
    return iter_weights(weight_files(folder), "cpu")


def checkpoint_keys(model: nn.Module) -> set[str]:
    """The keys `load_weights` reports for a complete checkpoint (its `expected_weights`,
    less the run-time parameters a conversion made, such as fp8 scales of weights quantized
    at load); empty for a model that cannot tell."""
    expected = getattr(model, "expected_weights", None)
    if expected is None:
        return set()
    derived = {f"{name}.{param}" for name, layer in _reloaded_layers(model)
               for param, _ in layer.named_parameters(recurse=False)
               if param not in ("weight", "bias")}
    return {key for key in expected() if key.split("#")[0] not in derived}


class _StagedLayer:
    """A layer converted after loading, back in its checkpoint form for an update."""

    def __init__(self, item: tuple[str, Linear], dtype: torch.dtype) -> None:
        self.name, self.layer = item
        layer = self.layer
        self.runtime = dict(layer.named_parameters(recurse=False))
        weight = layer.quant.dequantized_weight(layer).to(dtype)
        delattr(layer, "weight")
        add_param(layer, "weight", weight, layer.param_layouts["weight"])

    def finish(self, is_touched: bool) -> None:
        """Convert the update into the old tensors; an untouched layer keeps them as they
        were (no round trip through the dequantized form)."""
        layer = self.layer
        if is_touched:
            layer.quant.process_after_loading(layer)
        for name, old in self.runtime.items():
            new = getattr(layer, name)
            if is_touched and new is not old:
                old.data.copy_(new.data)
            if new is not old:
                delattr(layer, name)
                layer.register_parameter(name, old)


def _reloaded_layers(model: nn.Module) -> list[tuple[str, Linear]]:
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, Linear) and _is_fp8_at_load(module.quant)]


def _base_method(quant):
    """A LoRA wrapper's base method, or the method itself."""
    return getattr(quant, "base", quant)


def _is_fp8_at_load(quant) -> bool:
    quant = _base_method(quant)
    return isinstance(quant, Fp8LinearMethod) and not quant.scheme.checkpoint_is_fp8


def _is_updatable(quant) -> bool:
    """Methods whose run-time form an update can produce: the model dtype as it is, fp8
    quantized at load, fp8 checkpoints with per-channel scales (no conversion)."""
    if isinstance(quant, (UnquantizedMethod, UnquantizedMoEMethod)):
        return True
    if isinstance(quant, Fp8LinearMethod):
        scheme = quant.scheme
        return not scheme.checkpoint_is_fp8 or (scheme.weight == "channel"
                                                and scheme.activation == "dynamic")
    return False


def _touched_modules(loaded: set[str]) -> set[str]:
    """Module names of load_weights' keys ("layers.0.self_attn.qkv_proj.weight#1")."""
    return {key.split("#")[0].rpartition(".")[0] for key in loaded}


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _as_tensor(name: str, tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"update_weights: {name!r} must be a torch.Tensor, got "
                         f"{type(tensor).__name__}")
    return tensor.to(device)
