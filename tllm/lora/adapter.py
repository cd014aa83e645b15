"""A PEFT LoRA adapter folder read into plain tensors: `adapter_config.json` parsed by peft's
own `LoraConfig` (rank, lora_alpha, rslora, rank/alpha patterns, target modules), the
`lora_A` / `lora_B` weights from `adapter_model.safetensors` (or an `adapter_model.bin` that
torch loads with `weights_only`: plain tensors, nothing executed), each projection's scale;
checked against what an engine's layers accept (`LoraTargets`) before it is served. Anything
we cannot serve is a ValueError naming it."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from tllm.lora.request import LoRARequest
from tllm.lora.targets import LoraTargets

# The projections of a decoder layer an adapter may target (checkpoint names).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class LoraWeights:
    """One projection's adapter: A [r, in], B [out, r], and the scale of B @ A."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class Adapter:
    """An adapter's projections by checkpoint module name ("layers.0.self_attn.q_proj")."""

    request: LoRARequest
    modules: dict[str, LoraWeights]

    @property
    def max_rank(self) -> int:
        return max(w.rank for w in self.modules.values())


def read_adapter(request: LoRARequest, max_rank: int) -> Adapter:
    """The adapter at `request.lora_path`, checked against what a LoRA engine serves."""
    config = _read_config(request)
    tensors = _read_tensors(request.lora_path)
    modules = _pair_weights(request, config, tensors)
    adapter = Adapter(request, modules)
    if adapter.max_rank > max_rank:
        raise ValueError(f"lora_request {request.lora_name!r}: rank {adapter.max_rank} is "
                         f"above max_lora_rank ({max_rank})")
    return adapter


def _read_config(request: LoRARequest):
    from peft import LoraConfig
    path = request.lora_path
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(f"lora_request {request.lora_name!r}: no adapter_config.json in "
                         f"{path!r}")
    try:
        config = LoraConfig.from_pretrained(path)
    except Exception as exc:  # peft's own parse error (bad JSON, unknown fields)
        raise ValueError(f"lora_request {request.lora_name!r}: adapter_config.json in "
                         f"{path!r} cannot be read: {exc}") from None
    name = request.lora_name
    if getattr(config, "peft_type", None) is not None and str(config.peft_type.value) != "LORA":
        raise ValueError(f"lora_request {name!r}: peft_type {config.peft_type.value} is not "
                         "LORA")
    if getattr(config, "use_dora", False):
        raise ValueError(f"lora_request {name!r}: DoRA adapters (use_dora) are not supported")
    if config.bias != "none":
        raise ValueError(f"lora_request {name!r}: adapters that train biases (bias="
                         f"{config.bias!r}) are not supported")
    if config.modules_to_save:
        raise ValueError(f"lora_request {name!r}: modules_to_save "
                         f"({sorted(config.modules_to_save)}) are not supported")
    if getattr(config, "fan_in_fan_out", False):
        raise ValueError(f"lora_request {name!r}: fan_in_fan_out adapters are not supported")
    targets = config.target_modules
    if isinstance(targets, (set, list, tuple)):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(f"lora_request {name!r}: target module(s) {unknown} are not "
                             f"supported (supported: {', '.join(TARGET_MODULES)})")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    safetensors_path = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(safetensors_path):
        from safetensors.torch import load_file
        try:
            return load_file(safetensors_path)
        except Exception as exc:
            raise ValueError(f"adapter weights {safetensors_path!r} cannot be read: "
                             f"{exc}") from None
    bin_path = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_path):
        return _read_bin(bin_path)
    raise ValueError(f"no adapter_model.safetensors (or adapter_model.bin) in {path!r}")


def _read_bin(path: str) -> dict[str, torch.Tensor]:
    """A pickled state dict, loaded only if it holds nothing but tensors (weights_only: a
    pickle that would build other objects or call functions is refused, never run)."""
    refusal = (f"adapter weights {path!r} are not a plain state dict of tensors (torch.load "
               "with weights_only refused {}); save the adapter as adapter_model.safetensors")
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's advice (weights_only=False) is not for a client
        raise ValueError(refusal.format(type(exc).__name__)) from None
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise ValueError(refusal.format(f"nothing, but it holds a {type(tensors).__name__}"))
    return tensors


def _pair_weights(request: LoRARequest, config, tensors: dict[str, torch.Tensor]
                  ) -> dict[str, LoraWeights]:
    from peft.utils.other import get_pattern_key
    name = request.lora_name
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"lora_request {name!r}: tensor {key!r} is not a LoRA weight "
                             "(lora_A / lora_B) we can serve")
        module = match["module"].removeprefix("base_model.model.")
        halves.setdefault(module, {})[match["which"]] = tensor
    if not halves:
        raise ValueError(f"lora_request {name!r}: the adapter has no lora_A / lora_B weights")
    modules = {}
    for module, pair in halves.items():
        projection = module.rsplit(".", 1)[-1]
        if projection not in TARGET_MODULES:
            raise ValueError(f"lora_request {name!r}: target module {projection!r} ({module}) "
                             f"is not supported (supported: {', '.join(TARGET_MODULES)})")
        if set(pair) != {"A", "B"}:
            raise ValueError(f"lora_request {name!r}: {module} has lora_{''.join(pair)} "
                             "without its other half")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] < 1:
            raise ValueError(f"lora_request {name!r}: {module} has lora_A {tuple(a.shape)} "
                             f"and lora_B {tuple(b.shape)}; expected [r, in] and [out, r], "
                             "r >= 1")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(f"lora_request {name!r}: {module} has lora_A of {a.dtype} and "
                             f"lora_B of {b.dtype}; expected floating-point weights")
        rank = a.shape[0]
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module),
                                         config.lora_alpha)
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        modules[module.removeprefix("model.")] = LoraWeights(a, b, float(scale))
    return modules


def check_adapter(request: LoRARequest, targets: LoraTargets) -> Adapter:
    """The adapter read and checked against an engine's layers: what the engine would
    refuse at its first request is refused here (rank, files, modules, shapes)."""
    adapter = read_adapter(request, targets.max_rank)
    targets.check(adapter)
    return adapter
