"""Loading diffusers-named weights into transformers that fuse some of diffusers' linears
(Q/K/V, the two streams' modulations, ...) into one: each diffusers tensor names its slot of
rows in one of our parameters; the loader checks shapes, duplicates and that every slot of
every parameter was filled."""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from tllm.loader.hf import CheckpointError

# diffusers parameter name -> (our parameter name, first row slot, number of equal slots of
# rows in it[, slots this tensor spans, default 1]); None: skip the tensor
NameMap = Callable[[str], "tuple | None"]


def _rows(param: torch.Tensor, mapped: tuple) -> tuple[slice, range]:
    """The rows of `param` a mapped tensor fills, and the slots they are."""
    _, slot, slots, *span = mapped
    span = span[0] if span else 1
    rows = param.shape[0] // slots
    return slice(slot * rows, (slot + span) * rows), range(slot, slot + span)


class FusedWeightLoader:
    """Copies diffusers-named tensors into the model's (fused) parameters, one at a time."""

    def __init__(self, model: nn.Module, our_name: NameMap, family: str) -> None:
        self.params = dict(model.named_parameters())
        self.our_name = our_name
        self.family = family
        self.filled: dict[str, set[int]] = {}
        self.slots: dict[str, int] = {}

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        mapped = self.our_name(name)
        if mapped is None:
            return
        ours, slots = mapped[0], mapped[2]
        if ours not in self.params:
            raise CheckpointError(f"unexpected weight {name!r} for a {self.family} transformer")
        param = self.params[ours]
        rows, covered = _rows(param, mapped)
        target = param[rows]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(target.shape)}")
        if self.filled.setdefault(ours, set()) & set(covered):
            raise CheckpointError(f"weight {name!r} given twice")
        target.copy_(tensor)
        self.filled[ours].update(covered)
        self.slots[ours] = slots

    def finish(self) -> None:
        missing = [n for n in self.params if len(self.filled.get(n, ())) != self.slots.get(n, 1)]
        if missing:
            raise CheckpointError(f"checkpoint lacks weights for {len(missing)} parameters, "
                                  f"e.g. {missing[:3]}")


def diffusers_views(model: nn.Module, names: list[str], our_name: NameMap
                    ) -> dict[str, torch.Tensor]:
    """Our weights under diffusers' `names`, as views of our fused parameters (no copies)."""
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        mapped = our_name(name)
        if mapped is None:
            continue
        out[name] = params[mapped[0]][_rows(params[mapped[0]], mapped)[0]]
    return out


@torch.no_grad()
def init_dummy_weights(model: nn.Module, num_layers: int, output_projections: tuple[str, ...],
                       seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks, generated on the model's device: norms at one, biases at
    zero, the rest normal(0, std), residual output projections scaled by 1/sqrt(2 * layers)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    out_std = std / math.sqrt(2 * num_layers)
    for name, param in model.named_parameters():
        module = name.rsplit(".", 2)[-2] if name.count(".") else ""
        if "norm" in name and not name.endswith("bias"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        elif module in output_projections:
            param.normal_(0.0, out_std, generator=generator)
        else:
            param.normal_(0.0, std, generator=generator)
