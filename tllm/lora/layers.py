"""LoRA inside the model's linear layers, on this rank: every projection an adapter may target
gets static stacked buffers (A [max_loras, slices * R, in], B [max_loras, out, R], this
rank's shard of them) and its quantization method is wrapped so that `apply` adds the
batched LoRA op to whatever the base method returns (bf16, fp8, int8, GGUF alike).

Tensor parallelism shards the adapters as the base layers: a column-parallel layer (q/k/v,
gate/up) keeps B's rows of its output slice and all of A; a row-parallel one (o, down) keeps
A's columns of its input slice and all of B, and its partial products are summed by the
layer's own all-reduce. A merged layer's projections are slices with their own A and B.

Which adapter each token uses is `TokenSlots`: the step's tokens grouped by slot, in static
buffers read by every layer (a captured CUDA graph reads them too), computed once at the
start of each step (`LoraModel.begin_step`), where the plan's adapter loads are applied
first. A step without adapters skips the LoRA op in eager forwards; a graph replay runs it
over an empty tile table, whose programs exit at once."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tllm.kernels.lora import add_lora
from tllm.kernels.lora_batch import LoraBatch
from tllm.layers.linear import (ColumnParallelLinear, Linear, MergedLinear, QKVLinear,
                                RowParallelLinear)
from tllm.layers.quant.base import QuantMethod
from tllm.lora.adapter import TARGET_MODULES, Adapter, check_adapter
from tllm.lora.request import LoRARequest
from tllm.lora.targets import LoraTargets


class TokenSlots:
    """The adapter slot of every token of the step, grouped by slot (`LoraBatch`: static
    device buffers every layer and a captured graph read), filled once per step."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device) -> None:
        self.batch = LoraBatch(max_tokens, max_loras, device)
        self.is_active = False  # some token of this step has an adapter

    def set(self, slots_per_request: list[int], query_lens: list[int]) -> None:
        self.is_active = any(slot >= 0 for slot in slots_per_request)
        if not self.is_active and not self.batch.has_adapters:
            return  # the table already says "no adapter" (a graph replay exits at once)
        self.batch.fill(np.repeat(np.asarray(slots_per_request, dtype=np.int32),
                                  query_lens))


@dataclass
class Projection:
    """One slice of a LoRA layer: the checkpoint projection it holds, where its rows sit in
    the layer's output, and which rows/columns of the full adapter tensors this rank keeps."""

    name: str            # checkpoint projection ("q_proj")
    out_start: int       # first output feature of the slice in the layer (this rank)
    out_rows: int        # output features of the slice on this rank
    full_out: int        # the slice's output features over all ranks (B's rows)
    b_first: int         # first row of the full B this rank keeps
    full_in: int         # A's columns over all ranks
    a_first: int         # first column of the full A this rank keeps


def checkpoint_name(module: str, projection: Projection) -> str:
    """The adapter's name of a projection: "layers.0.self_attn.q_proj" for the q slice of
    our "layers.0.self_attn.qkv_proj"."""
    return f"{module.rpartition('.')[0]}.{projection.name}"


class LoraLinearMethod(QuantMethod):
    """The layer's own method, plus every token's adapter delta added to its output."""

    def __init__(self, base: QuantMethod, layer: Linear, projections: list[Projection],
                 max_loras: int, max_rank: int, token_slots: TokenSlots,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.base = base
        self.name = base.name
        self.projections = projections
        self.max_rank = max_rank
        self.token_slots = token_slots
        num_slices = len(projections)
        self.a_stack = torch.zeros(max_loras, num_slices * max_rank, layer.in_features,
                                   dtype=dtype, device=device)
        self.b_stack = torch.zeros(max_loras, layer.out_features, max_rank, dtype=dtype,
                                   device=device)
        self.bounds = tuple([p.out_start for p in projections]
                            + [projections[-1].out_start + projections[-1].out_rows])

    def create_weights(self, layer, in_features, out_features, num_shards) -> None:
        self.base.create_weights(layer, in_features, out_features, num_shards)

    def process_after_loading(self, layer) -> None:
        self.base.process_after_loading(layer)

    def dequantized_weight(self, layer) -> torch.Tensor:
        return self.base.dequantized_weight(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        if not self.token_slots.is_active:
            return out
        return add_lora(out, x.to(self.a_stack.dtype), self.a_stack, self.b_stack,
                        self.token_slots.batch, self.bounds)

    def load(self, slot: int, adapter: Adapter, module: str) -> None:
        """This rank's shard of the adapter's projections of this layer into `slot`."""
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()
        r_max = self.max_rank
        for s, proj in enumerate(self.projections):
            weights = adapter.modules.get(checkpoint_name(module, proj))
            if weights is None:
                continue
            r = weights.rank
            a = weights.a[:, proj.a_first:proj.a_first + self.a_stack.shape[2]]
            b = weights.b[proj.b_first:proj.b_first + proj.out_rows] * weights.scale
            self.a_stack[slot, s * r_max:s * r_max + r].copy_(a)
            self.b_stack[slot, proj.out_start:proj.out_start + proj.out_rows, :r].copy_(b)


class LoraModel:
    """This rank's LoRA layers of `model` and a cache of adapters read from disk (the
    `max_cpu_loras` most recently used)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 max_tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.token_slots = TokenSlots(max_tokens, max_loras, device)
        self.layers: dict[str, LoraLinearMethod] = {}
        for name, layer, projections in _lora_targets(model):
            method = LoraLinearMethod(layer.quant, layer, projections, max_loras, max_rank,
                                      self.token_slots, dtype, device)
            layer.quant = method
            self.layers[name] = method
        if not self.layers:
            raise ValueError(f"enable_lora: {type(model).__name__} has no projections LoRA "
                             f"can target ({', '.join(TARGET_MODULES)})")
        self.targets = _targets_of(model, self.layers, max_rank)
        self._cache: OrderedDict[int, Adapter] = OrderedDict()
        self._max_cached = max_cpu_loras
        self._lock = threading.Lock()  # submissions read adapters on their own threads

    def adapter(self, request: LoRARequest) -> Adapter:
        """The adapter, read and checked against this rank's layers once, then cached."""
        with self._lock:
            cached = self._cache.get(request.lora_int_id)
            if cached is not None and cached.request == request:
                self._cache.move_to_end(request.lora_int_id)
                return cached
        adapter = check_adapter(request, self.targets)
        with self._lock:
            self._cache[request.lora_int_id] = adapter
            self._cache.move_to_end(request.lora_int_id)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return adapter

    def forget(self, lora_int_id: int) -> None:
        with self._lock:
            self._cache.pop(lora_int_id, None)

    def load(self, slot: int, request: LoRARequest) -> None:
        adapter = self.adapter(request)
        for name, method in self.layers.items():
            method.load(slot, adapter, name)

    def begin_step(self, loads: list[tuple[int, LoRARequest]], slots: list[int],
                   query_lens: list[int]) -> None:
        """Before a step's forward: the plan's adapter loads, then every token's slot."""
        for slot, request in loads:
            self.load(slot, request)
        self.token_slots.set(slots, query_lens)


def _targets_of(model: nn.Module, layers: dict[str, LoraLinearMethod],
                max_rank: int) -> LoraTargets:
    """Each projection's full (in, out) features, and the layers other stages hold."""
    shapes = {checkpoint_name(name, p): (p.full_in, p.full_out)
              for name, method in layers.items() for p in method.projections}
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", 0)
    stage_layers = getattr(model, "stage_layers", range(num_layers))  # no stages: all
    return LoraTargets(shapes, max_rank, frozenset(range(num_layers)) - set(stage_layers))


def _lora_targets(model: nn.Module):
    """(module name, layer, its projections) of every linear layer LoRA may adapt."""
    merged_names: dict[str, list[str]] = {}
    for ckpt, (merged, shard) in getattr(model, "stacked_params", {}).items():
        names = merged_names.setdefault(merged, [])
        names.extend([""] * (shard + 1 - len(names)))
        names[shard] = ckpt
    config = getattr(model, "config", None)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, Linear) or not name.startswith("layers."):
            continue
        if isinstance(module, MergedLinear) and leaf in merged_names:
            names = merged_names[leaf]
            if len(names) != len(module.output_sizes) or not set(names) <= set(TARGET_MODULES):
                continue
            yield name, module, _merged_projections(module, names, config)
        elif leaf in TARGET_MODULES and not isinstance(module, MergedLinear):
            yield name, module, [_single_projection(module, leaf)]


def _merged_projections(layer: MergedLinear, names: list[str], config) -> list[Projection]:
    projections, start = [], 0
    for shard, name in enumerate(names):
        first, rows = layer.shard_rows(shard)
        full = rows * layer.tp_size
        if isinstance(layer, QKVLinear) and shard > 0 and config is not None:
            num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            full = num_kv * layer.head_dim
        projections.append(Projection(name, start, rows, full, first, layer.in_features, 0))
        start += rows
    return projections


def _single_projection(layer: Linear, name: str) -> Projection:
    rows, cols = layer.out_features, layer.in_features
    if isinstance(layer, RowParallelLinear):
        return Projection(name, 0, rows, rows, 0, cols * layer.tp_size, layer.tp_rank * cols)
    if isinstance(layer, ColumnParallelLinear):
        return Projection(name, 0, rows, rows * layer.tp_size, layer.tp_rank * rows, cols, 0)
    return Projection(name, 0, rows, rows, 0, cols, 0)
